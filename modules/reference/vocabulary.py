"""A separately loaded model's vocabulary against the policy's (a distillation teacher): read from the configs
before any weights load, and from the built models' output embeddings after."""

from __future__ import annotations

from typing import Any

import torch


def model_vocab_size(model_or_path: Any, init_kwargs: dict[str, Any] | None = None,
                     trust_remote_code: bool = False, what: str = "Model", knob: str | None = None) -> int | None:
    """The vocabulary size a model's logits have, from its config (a folder/hub name: ``config.json`` only, no
    weights read). None when it cannot be told (no config). ``what`` / ``knob``: how a missing folder is named."""
    if isinstance(model_or_path, torch.nn.Module):
        if hasattr(model_or_path, "get_output_embeddings") and model_or_path.get_output_embeddings() is not None:
            weight = model_or_path.get_output_embeddings().weight
            # under DeepSpeed ZeRO-3 a parameter is an empty placeholder of its partition; ds_shape is its full shape
            return int(getattr(weight, "ds_shape", weight.shape)[0])
        config = getattr(model_or_path, "config", None)
    else:
        from transformers import AutoConfig

        from lightalign.hub import _check_local_folder, _hub_kwargs

        _check_local_folder(model_or_path, what, knob)
        revision = {k: v for k, v in (init_kwargs or {}).items() if k == "revision"}
        config = AutoConfig.from_pretrained(model_or_path, trust_remote_code=trust_remote_code,
                                            **_hub_kwargs(model_or_path), **revision)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    size = getattr(config, "vocab_size", None)
    return None if size is None else int(size)


def check_same_vocabulary(student: Any, teacher: Any, student_kwargs: dict[str, Any] | None,
                          teacher_kwargs: dict[str, Any] | None, trust_remote_code: bool) -> None:
    """Refuse a teacher (a built model or a name/folder) whose vocabulary differs from the student's."""
    student_size = model_vocab_size(student, student_kwargs, trust_remote_code, "Student", "model_name_or_path")
    teacher_size = model_vocab_size(teacher, teacher_kwargs, trust_remote_code, "Teacher",
                                    "teacher_model_name_or_path")
    if student_size is not None and teacher_size is not None and student_size != teacher_size:
        raise ValueError(
            f"The teacher's vocabulary ({teacher_size} tokens, {describe_model(teacher)}) differs from the student's "
            f"({student_size} tokens, {describe_model(student)}): distillation compares their distributions token by "
            "token over output layers of the same size. Models of one family can differ here only because their "
            "embedding matrices are padded to different sizes (e.g. a family's large and small checkpoints): "
            "lightalign does not map padded vocabularies yet; pick a teacher and student whose configs give the "
            "same vocab_size, or distil across tokenizers with lightalign.GOLDModule and use_uld_loss: true "
            "(Universal Logit Distillation: the teacher re-tokenises the student's text; docs/gold.md).")


def describe_model(model_or_path: Any) -> str:
    if isinstance(model_or_path, torch.nn.Module):
        path = getattr(getattr(model_or_path, "config", None), "_name_or_path", "")
        return f"a built {type(model_or_path).__name__}" + (f" from '{path}'" if path else "")
    return f"'{model_or_path}'"
