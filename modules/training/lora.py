"""LoRA (peft) and activation checkpointing: how the policy is wrapped before training (``PolicyModule``)."""

from __future__ import annotations

from typing import Any

import torch


def apply_peft(model: torch.nn.Module, peft_config: Any) -> torch.nn.Module:
    """Wrap ``model`` with LoRA (or any peft config); only the adapter parameters stay trainable."""
    try:
        import peft
    except ImportError as err:
        raise ImportError("peft_config needs the peft package: pip install 'lightalign[peft]'") from err
    if isinstance(peft_config, dict):
        cfg = dict(peft_config)
        cfg.setdefault("task_type", "CAUSAL_LM")
        peft_type = cfg.pop("peft_type", "LORA").upper()
        config_cls = {"LORA": peft.LoraConfig}.get(peft_type)
        if config_cls is None:
            raise ValueError(f"peft_config.peft_type '{peft_type}' is not supported from YAML; use LORA or pass a peft config object.")
        peft_config = config_cls(**cfg)
    return peft.get_peft_model(model, peft_config)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation (gradient) checkpointing; transformers 5 renamed the method."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")
