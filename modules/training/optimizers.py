"""Optimizers and learning-rate schedules: the default AdamW's parameter groups and fused kernel, the warmup +
decay schedule, and named optimizer presets (the ``optim`` names of TRL and the transformers Trainer).

``build_named_optimizer("adamw_8bit", model, lr=...)`` builds the optimizer over the model's trainable parameters
only. The presets that need an optional package import it here, lazily, and say which extra installs it.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

import torch

ScheduleType = Literal["linear", "cosine", "constant", "cosine_with_min_lr"]


def schedule_factor(
    step: int,
    total_steps: int,
    warmup_steps: int,
    schedule: ScheduleType,
    min_lr_rate: float = 0.0,
) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (linear warmup, then the schedule)."""
    if warmup_steps > 0 and step < warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "cosine":
        return cosine
    if schedule == "cosine_with_min_lr":
        return min_lr_rate + (1.0 - min_lr_rate) * cosine
    raise ValueError(f"Unknown lr_scheduler_type '{schedule}'; use one of linear, cosine, constant, cosine_with_min_lr.")


#: Strategies whose gradient clipping ``PolicyModule.configure_gradient_clipping`` does itself.
CLIPS_ITSELF = ("SingleDeviceStrategy", "DDPStrategy")


def fused_adamw_applies(groups: list[dict[str, Any]], trainer: Any = None) -> bool:
    """The fused AdamW kernel (transformers' default ``adamw_torch_fused``): one kernel per step instead of a
    Python loop of per-tensor ops. Used for plain floating-point tensors on CPU or CUDA; not under DeepSpeed
    (its ZeRO optimizer drives the steps), with sharded (DTensor) parameters, or with fp16 loss scaling (the
    scaler must unscale gradients before they are clipped). Under ``bf16-mixed`` (no scaler) it is used where
    ``PolicyModule.configure_gradient_clipping`` clips (``CLIPS_ITSELF``): Lightning's ``MixedPrecision`` refuses
    clipping for any fused optimizer, a rule about fp16's scaler that bf16 does not have."""
    strategy = type(getattr(trainer, "strategy", None)).__name__ if trainer is not None else ""
    precision = str(getattr(trainer, "precision", ""))
    if "DeepSpeed" in strategy or precision == "16-mixed":
        return False
    if precision == "bf16-mixed" and strategy not in CLIPS_ITSELF:
        return False
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(
        type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point
        for p in params
    )


def decay_parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters split like the transformers Trainer: no weight decay on biases and norm weights."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or "norm" in name.lower() or name.endswith(".bias"):
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]



#: preset name -> (package to import, what it is); the keys are the accepted ``optim`` values.
PRESETS = {
    "adamw_torch": "torch.optim.AdamW",
    "adamw_torch_fused": "torch.optim.AdamW(fused=True)",
    "adamw_8bit": "bitsandbytes AdamW8bit",
    "adamw_bnb_8bit": "bitsandbytes AdamW8bit",
    "adam_8bit": "bitsandbytes Adam8bit",
    "paged_adamw_8bit": "bitsandbytes PagedAdamW8bit",
    "lion": "lion-pytorch Lion",
    "lion_8bit": "bitsandbytes Lion8bit",
    "galore_adamw": "galore-torch GaLoreAdamW",
    "galore_adamw_8bit": "galore-torch GaLoreAdamW8bit (needs a CUDA GPU)",
    "galore_adafactor": "galore-torch GaLoreAdafactor",
}
GALORE_KEYS = ("rank", "update_proj_gap", "scale", "proj_type")


def check_optim_name(optim: str) -> None:
    if optim not in PRESETS:
        raise ValueError(f"optim='{optim}' is unknown; use one of {', '.join(PRESETS)} (or pass `optimizer` for any other).")


def _import(module: str, extra: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"optim '{what}' needs the {module.split('.')[0]} package: pip install 'lightalign[{extra}]'") from err


def check_optimizer_instance(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
    """An optimizer passed ready-made must hold this model's trainable parameters only (and all of them)."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if held != trainable:
        raise ValueError(
            f"The optimizer passed as `optimizer` holds {len(held - trainable)} parameter(s) that are not trainable "
            f"parameters of the model and misses {len(trainable - held)} trainable one(s). Build it over "
            "[p for p in model.parameters() if p.requires_grad] of the model you pass, or pass a factory "
            "(params -> optimizer) instead (needed when the module loads the model itself, or with peft_config)."
        )
    return optimizer


def galore_target_parameters(model: torch.nn.Module, target_modules: list[str] | str) -> list[torch.nn.Parameter]:
    """Weights of the trainable ``nn.Linear`` modules whose name matches a target (a regex matching the whole
    name, or a plain substring of it), as the transformers Trainer selects them for GaLore."""
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not module.weight.requires_grad:
            continue
        if any(re.fullmatch(t, name) or t in name for t in targets):
            found.append(module.weight)
    if not found:
        raise ValueError(
            f"optim_target_modules {targets} matched no trainable nn.Linear module of the model; name them by a "
            "regex or a substring of their names, e.g. ['attn', 'mlp'] or ['.*self_attn.*']."
        )
    return found


def build_named_optimizer(
    optim: str,
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    optim_args: dict[str, Any] | None = None,
    optim_target_modules: list[str] | str | None = None,
) -> torch.optim.Optimizer:
    """The ``optim`` preset over the trainable parameters of ``model`` (no weight decay on biases and norms).

    ``optim_args`` are extra keyword arguments of the optimizer (they win over the defaults above); for GaLore
    they also hold ``rank`` (128), ``update_proj_gap`` (200), ``scale`` (0.25) and ``proj_type`` (``std``),
    applied to the parameters ``optim_target_modules`` selects.
    """

    args = dict(optim_args or {})
    if optim.startswith("galore"):
        return _build_galore(optim, model, lr, weight_decay, betas, eps, args, optim_target_modules)
    groups = decay_parameter_groups(model, weight_decay)
    if optim in ("adamw_torch", "adamw_torch_fused"):
        fused = {"fused": True} if optim == "adamw_torch_fused" else {}
        return torch.optim.AdamW(groups, **{"lr": lr, "betas": betas, "eps": eps, **fused, **args})
    if optim == "lion":
        lion = _import("lion_pytorch", "optim", optim)
        return lion.Lion(groups, **{"lr": lr, "betas": (0.9, 0.99), **args})
    bnb = _import("bitsandbytes.optim", "bnb", optim)
    if optim == "lion_8bit":
        return bnb.Lion8bit(groups, **{"lr": lr, "betas": (0.9, 0.99), **args})
    cls = {"adamw_8bit": bnb.AdamW8bit, "adamw_bnb_8bit": bnb.AdamW8bit, "adam_8bit": bnb.Adam8bit,
           "paged_adamw_8bit": bnb.PagedAdamW8bit}[optim]
    return cls(groups, **{"lr": lr, "betas": betas, "eps": eps, **args})


def check_optim_preset(optim: str, optim_target_modules: list[str] | str | None) -> None:
    """``optim`` names a preset, with ``optim_target_modules`` exactly when it is a GaLore one, and a GPU when it
    needs one."""
    check_optim_name(optim)
    galore = optim.startswith("galore")
    if not galore and optim_target_modules is not None:
        raise ValueError(f"optim_target_modules only applies to the galore_* presets, not optim='{optim}'.")
    if galore and optim_target_modules is None:
        raise ValueError(f"optim='{optim}' needs optim_target_modules (e.g. ['attn', 'mlp']): the linear layers to project.")
    if optim == "galore_adamw_8bit" and not torch.cuda.is_available():
        raise RuntimeError(
            "optim='galore_adamw_8bit' needs a CUDA GPU (galore-torch's 8-bit AdamW synchronizes CUDA at every step). "
            "On CPU use galore_adamw or galore_adafactor."
        )


def _build_galore(optim, model, lr, weight_decay, betas, eps, args, target_modules) -> torch.optim.Optimizer:
    galore = _import("galore_torch", "optim", optim)
    galore_params = galore_target_parameters(model, target_modules)
    galore_ids = {id(p) for p in galore_params}
    others = [p for p in model.parameters() if p.requires_grad and id(p) not in galore_ids]
    settings = {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
    settings.update({k: args.pop(k) for k in GALORE_KEYS if k in args})
    groups = [{"params": others}, {"params": galore_params, **settings}]
    groups = [g for g in groups if g["params"]]
    if optim == "galore_adafactor":
        # Adafactor with an explicit lr (its relative-step mode would ignore learning_rate)
        defaults = {"lr": lr, "weight_decay": weight_decay, "relative_step": False, "scale_parameter": False,
                    "warmup_init": False}
        return galore.GaLoreAdafactor(groups, **{**defaults, **args})
    cls = galore.GaLoreAdamW if optim == "galore_adamw" else galore.GaLoreAdamW8bit
    return cls(groups, **{"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, **args})
