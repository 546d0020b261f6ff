"""Reference models for DPO-style losses: frozen copies, shared-layer copies, quantized loads, a log-prob cache.

Modes (chosen by ``DPOModule``):

* a frozen copy of the policy (default) or of another checkpoint (``ref_model_name_or_path``);
* shared layers (``num_shared_layers=k``): the first k decoder layers (and everything before them, e.g. the
  embeddings) are the *same tensors* as the policy's and frozen in both; the rest is a frozen copy;
* quantized: loaded 8-bit/4-bit through ``ref_model_init_kwargs.quantization_config`` (bitsandbytes);
* precomputed log-probs: one pass before training, cached on disk by fingerprint, then the model is released;
* LoRA policy: the base model with adapters disabled (no copy).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from lightalign.modules.training.lora import disable_cpu_4bit_repacking  # noqa: F401  (was defined here)

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer|decoder\.layers)\.(\d+)\.")


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode, no gradients: a reference model is never trained."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def shared_parameter_names(model: torch.nn.Module, num_shared_layers: int) -> list[str]:
    """Parameters up to (not including) decoder layer ``num_shared_layers``, in registration order."""
    names = []
    seen_layer = False
    for name, _ in model.named_parameters():
        match = _LAYER_INDEX.search(name)
        if match:
            seen_layer = True
            if int(match.group(1)) >= num_shared_layers:
                break
        names.append(name)
    if not seen_layer:
        raise ValueError(
            "num_shared_layers: no decoder layers found in the parameter names (expected '...layers.<i>.' or "
            "'...h.<i>.'); this architecture cannot share layers."
        )
    return names


def create_reference_model(model: torch.nn.Module, num_shared_layers: int | None = None) -> torch.nn.Module:
    """A frozen reference for ``model``; with ``num_shared_layers=k`` the first k layers are shared tensors.

    Shared parameters are frozen in the policy too (both models see the same values all along, which is what
    makes sharing sound). The copy of the other parameters never allocates the shared ones twice.
    """
    memo: dict[int, Any] = {}
    if num_shared_layers:
        params = dict(model.named_parameters())
        num_layers = len({m.group(1) for n in params if (m := _LAYER_INDEX.search(n))})
        if not 0 < num_shared_layers <= num_layers:
            raise ValueError(f"num_shared_layers={num_shared_layers} must be between 1 and the model's {num_layers} layers.")
        for name in shared_parameter_names(model, num_shared_layers):
            param = params[name]
            param.requires_grad_(False)
            memo[id(param)] = param  # deepcopy returns the same object for these
    ref = copy.deepcopy(model, memo)
    return freeze(ref)


def unique_parameter_count(*models: torch.nn.Module) -> int:
    """Parameters held in memory by several models together (shared tensors counted once)."""
    seen: dict[int, int] = {}
    for model in models:
        for p in model.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def quantization_kwargs(init_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``quantization_config`` given as a dict in YAML -> ``BitsAndBytesConfig``."""
    kwargs = dict(init_kwargs or {})
    qc = kwargs.get("quantization_config")
    if isinstance(qc, dict):
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as err:
            raise ImportError(
                "ref_model_init_kwargs.quantization_config needs bitsandbytes: pip install 'lightalign[bnb]'"
            ) from err
        from transformers import BitsAndBytesConfig

        qc = dict(qc)
        for key in ("bnb_4bit_compute_dtype",):
            if isinstance(qc.get(key), str):
                qc[key] = getattr(torch, qc[key].removeprefix("torch."))
        kwargs["quantization_config"] = BitsAndBytesConfig(**qc)
    return kwargs


def build_reference(
    policy: torch.nn.Module,
    name_or_path: str | None,
    separate: bool = False,
    init_kwargs: dict[str, Any] | None = None,
    num_shared_layers: int | None = None,
    trust_remote_code: bool = False,
) -> torch.nn.Module | None:
    """The reference of ``policy``: a separately loaded checkpoint (``separate``: another path or quantized
    kwargs), ``None`` for a LoRA policy (use ``disable_adapter()``), or a frozen (shared-layer) copy."""
    from lightalign.hub import load_causal_lm
    from lightalign.modules.training.lora import is_peft_model

    if separate:
        from lightalign.strategies.sharding import loading_whole

        with loading_whole():  # ZeRO-3: a whole, replicated reference, not a partition nobody gathers
            ref = load_causal_lm(name_or_path, init_kwargs=quantization_kwargs(init_kwargs),
                                 trust_remote_code=trust_remote_code)
        disable_cpu_4bit_repacking(ref)
        from lightalign.modules.adaptations.attention import use_varlen_sdpa

        use_varlen_sdpa(ref)  # like the policy: shared-prefix segments attend on their own
        return freeze(ref)
    if is_peft_model(policy):
        return None
    from lightalign.strategies.sharding import full_parameters_for_copy

    with full_parameters_for_copy(policy):  # ZeRO-3: copy whole weights; the copy stays replicated and unwrapped
        return create_reference_model(policy, num_shared_layers)


def move_reference(ref: torch.nn.Module | None, device: torch.device, policy: torch.nn.Module | None = None,
                   init_kwargs: dict[str, Any] | None = None) -> None:
    """Put an unregistered reference on the module's device (quantized models stay where bitsandbytes put them),
    in the floating dtype of ``policy``'s weights: Lightning's ``*-true`` precisions convert only registered
    submodules, and a float32 reference next to a bf16/float64 policy would make the first step's log-ratios
    non-zero (as in TRL, the reference runs in the policy's dtype). A dtype set in ``ref_model_init_kwargs``
    (``dtype`` / ``torch_dtype``) is kept."""
    if ref is None or getattr(ref, "is_loaded_in_8bit", False) or getattr(ref, "is_loaded_in_4bit", False):
        return
    dtype = None
    if policy is not None and not {"dtype", "torch_dtype"} & set(init_kwargs or {}):
        embeddings = policy.get_input_embeddings() if hasattr(policy, "get_input_embeddings") else None
        weight = getattr(embeddings, "weight", None)
        if weight is not None and weight.is_floating_point():
            dtype = weight.dtype
    ref.to(device=device, dtype=dtype) if dtype is not None else ref.to(device)


# --------------------------------------------------------------------------------------------- log-prob cache
def tensor_bytes(tensor: torch.Tensor) -> Any:
    """The raw bytes of a tensor, on the CPU (a DTensor is gathered whole first: every rank must call it)."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def model_fingerprint(model: torch.nn.Module, extra: Any = None) -> str:
    """The identity of a model's weights: every state-dict entry's name, shape, dtype and bytes (blake2b).

    Every byte counts, so two references that differ in one weight anywhere (a merged LoRA on a late layer)
    get different keys. blake2b reads about a gigabyte a second on one core: seconds for billions of parameters,
    once per run, next to a forward pass over the whole dataset.
    """
    h = hashlib.blake2b(digest_size=16)
    for name, tensor in model.state_dict().items():
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(tensor_bytes(tensor))
    if extra is not None:
        h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def tokenized_fingerprint(dataset: Any, columns: tuple[str, ...]) -> str:
    """The identity of tokenized rows: the token ids of ``columns`` (lists of ints), in row order."""
    h = hashlib.blake2b(digest_size=16)
    present = [c for c in columns if c in dataset.column_names]
    h.update(f"{len(dataset)}:{present}".encode())
    for table in dataset.select_columns(present).with_format("arrow").iter(batch_size=8192):
        for name in present:
            column = table.column(name).combine_chunks()
            if hasattr(column, "value_lengths"):  # list column: the row lengths, then every id
                h.update(column.value_lengths().to_numpy(zero_copy_only=False).astype("int64").tobytes())
                column = column.flatten()
            h.update(column.to_numpy(zero_copy_only=False).astype("int64").tobytes())
    return h.hexdigest()


def images_fingerprint(dataset: Any) -> str:
    """The identity of the images tokenized rows show (their stored ``images`` column: each image's bytes, read
    from its file where it is stored by path), in row order; ``""`` for rows without an image column, so text
    rows keep their key. Two images of one size expand to the same tokens, so the token ids alone cannot tell
    them apart."""
    if "images" not in dataset.column_names:
        return ""
    h = hashlib.blake2b(digest_size=16)
    for images in dataset["images"]:
        h.update(f"{len(images)}:".encode())
        for image in images:
            data = image["bytes"] if image.get("bytes") is not None else Path(image["path"]).read_bytes()
            h.update(hashlib.blake2b(data, digest_size=16).digest())
    return h.hexdigest()


def default_cache_dir() -> Path:
    root = os.environ.get("LIGHTALIGN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lightalign")
    return Path(root) / "ref_logps"


def cache_path(cache_dir: str | os.PathLike | None, ref_fingerprint: str, data_fingerprint: str) -> Path:
    key = hashlib.sha256(f"{ref_fingerprint}|{data_fingerprint}".encode()).hexdigest()[:32]
    return Path(cache_dir or default_cache_dir()) / f"{key}.pt"


def load_cached(path: Path) -> dict[str, torch.Tensor] | None:
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def save_cached(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Atomic write: a crash never leaves a half-written cache file under the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(tensors, tmp)
    os.replace(tmp, path)
