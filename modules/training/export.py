"""The Hugging Face export of a policy: ``save_pretrained`` of model and tokenizer, written atomically."""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightalign.modules.training.dropout import user_dropout_config
from lightalign.modules.training.lora import is_peft_model


def export_hf(model: torch.nn.Module, output_dir: str | os.PathLike, tokenizer: Any = None, merge_lora: bool = False,
              state_dict: dict[str, torch.Tensor] | None = None, random_base: bool = False) -> Path:
    """Write a Hugging Face model folder (``save_pretrained`` of model and tokenizer), atomically. ``tokenizer``: a
    tokenizer or a vision-language model's processor (tokenizer, image processor and chat template:
    ``AutoProcessor`` loads the folder), or its name or folder (loaded with ``lightalign.hub.load_tokenizer``, or
    ``lightalign.vision.load_processor`` for a vision-language model).

    The folder is written under a temporary name beside ``output_dir`` and renamed into place, so a crash
    mid-write leaves the previous export intact. With LoRA, the adapters are saved; ``merge_lora`` saves a
    merged full model instead (merged on a copy, so training can go on). ``state_dict``: the full weights of
    a sharded model (``lightalign.strategies.full_state_dict``), written instead of the local shards.
    ``random_base``: the model was built with random weights (``from_config``), saved nowhere; with LoRA an adapter
    alone could not be used, so the merged model is written instead (with a warning).
    """
    from lightalign.callbacks.nonfinite import first_nonfinite

    output_dir = Path(output_dir)
    bad = first_nonfinite(state_dict.items() if state_dict else model.named_parameters())
    if bad is not None:
        raise FloatingPointError(f"Refusing to export to '{output_dir}': parameter '{bad}' holds NaN/inf. Export "
                                 "from a checkpoint taken before the weights went non-finite.")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    if is_peft_model(model) and random_base and not merge_lora:
        from lightning.pytorch.utilities import rank_zero_warn

        if state_dict is None:
            merge_lora = True
            rank_zero_warn(f"LoRA on a from_config model (random base weights, saved nowhere): an adapter alone could "
                           f"not be loaded, so {output_dir} gets the merged model (base + LoRA) instead.")
        else:
            rank_zero_warn(f"LoRA on a from_config model: {output_dir} gets the adapter only, and its base model "
                           "(random weights) is saved nowhere. Set --export.merge_lora true to export it merged.")
    if is_peft_model(model) and merge_lora:
        model = copy.deepcopy(model).merge_and_unload()
    tmp = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tmp-", dir=output_dir.parent))
    try:
        config = getattr(model, "config", None)
        use_cache = getattr(config, "use_cache", None)
        if config is not None:
            config.use_cache = True  # generation from the export should use the KV cache
        try:  # the user's dropout values in config.json, also when disable_dropout zeroed them for training
            with user_dropout_config(model):
                model.save_pretrained(tmp, safe_serialization=True, **({"state_dict": state_dict} if state_dict else {}))
        finally:
            if config is not None and use_cache is not None:
                config.use_cache = use_cache
        if isinstance(tokenizer, (str, os.PathLike)):  # a name or folder, as the datamodules take it
            from lightalign.hub import is_vision_language_model, load_tokenizer

            if Path(tokenizer, "config.json").is_file() and is_vision_language_model(str(tokenizer)):
                from lightalign.vision import load_processor

                tokenizer = load_processor(str(tokenizer))
            else:
                tokenizer = load_tokenizer(str(tokenizer))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        # mkdtemp makes the folder 0700 and safetensors writes 0600 files: give the export the permissions a
        # plain mkdir/open would (the umask's), or nobody else could read the model.
        umask = os.umask(0)
        os.umask(umask)
        for folder, _, files in os.walk(tmp):
            os.chmod(folder, 0o777 & ~umask)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o666 & ~umask)
        old = None
        if output_dir.exists():
            old = output_dir.with_name(f".{output_dir.name}.old-{os.getpid()}")
            os.replace(output_dir, old)
        os.replace(tmp, output_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output_dir


def unfinished_exports(output_dir: str | os.PathLike) -> list[Path]:
    """The temporary folders ``export_hf`` left beside ``output_dir`` when its process was killed mid-export:
    ``.<name>.tmp-XXXXXXXX`` of the final export and of the ``checkpoint-N`` exports beside it (mkdtemp's names:
    8 characters of ``[a-z0-9_]``), nothing else."""
    output_dir = Path(output_dir)
    pattern = re.compile(rf"^\.({re.escape(output_dir.name)}|checkpoint-\d+)\.tmp-[a-z0-9_]{{8}}$")
    if not output_dir.parent.is_dir():
        return []
    return sorted(p for p in output_dir.parent.iterdir() if pattern.match(p.name) and p.is_dir() and not p.is_symlink())
