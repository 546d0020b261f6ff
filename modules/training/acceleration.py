"""Speed knobs of the policy: ``torch.compile`` (in place, parameter names unchanged), Liger kernels, and the CPU
allocator setting of CPU training (``retain_freed_cpu_memory``)."""

from __future__ import annotations

import ctypes
import platform
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


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
RETAIN_BYTES = 1 << 30


def retain_freed_cpu_memory(limit: int = RETAIN_BYTES) -> bool:
    """Keep freed CPU memory in the process instead of handing it back to the OS after every free (glibc only).

    By default glibc serves blocks above a sliding threshold (up to 32 MB) with fresh ``mmap`` pages and returns
    memory above the heap top to the OS; a training step frees and re-allocates its activations and gradients
    every time, so each step page-faults them in again (up to a quarter of a small-model DPO step on this
    project's CPU machine). Raising both thresholds to ``limit`` makes blocks below it reuse the process's heap:
    peak RSS stays the same (the next step reuses what the last one freed), but the process no longer shrinks
    after a peak. Process-wide and not undone; returns whether glibc took both settings (False elsewhere).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    took = [libc.mallopt(option, limit) for option in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD)]
    return all(took)
