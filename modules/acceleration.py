"""Speed knobs of the policy: ``torch.compile`` (in place, parameter names unchanged) and Liger kernels."""

from __future__ import annotations

from typing import Any

import torch


def compile_model(model: torch.nn.Module, options: bool | dict[str, Any]) -> torch.nn.Module:
    """``torch.compile`` the model in place (``nn.Module.compile``): state-dict keys, checkpoints and the Hugging
    Face export stay those of the plain model. ``options`` is ``True`` or the keyword arguments of
    ``torch.compile`` (``mode``, ``dynamic``, ``backend`` …)."""
    kwargs = dict(options) if isinstance(options, dict) else {}
    model.compile(**kwargs)
    return model


def apply_liger_kernel(model: torch.nn.Module) -> torch.nn.Module:
    """Swap the model's RMSNorm, RoPE, SwiGLU and cross-entropy for Liger's fused Triton kernels (GPU only)."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as err:
        raise ImportError("use_liger_kernel needs the liger-kernel package: pip install 'lightalign[liger]'") from err
    if not torch.cuda.is_available():
        raise RuntimeError(
            "use_liger_kernel needs a CUDA GPU: Liger's kernels are Triton GPU kernels and fail on CPU "
            "('0 active drivers'). Set use_liger_kernel: false to train on this machine."
        )
    _apply_liger_kernel_to_instance(model=model)
    return model
