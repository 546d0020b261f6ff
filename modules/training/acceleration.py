"""Speed knobs of the policy: ``torch.compile`` (in place, parameter names unchanged), Liger kernels, and the CPU
allocator setting of CPU training (``retain_freed_cpu_memory``, undone by ``release_freed_cpu_memory``)."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
from typing import Any

import torch

from lightalign.knobs import KnobGroup, knob


@dataclasses.dataclass(frozen=True)
class CPUMemoryKnobs(KnobGroup):
    group = "cpu_memory"
    retain_cpu_memory: bool = knob(
        True, "when training on CPU under glibc, keep freed memory in the process instead of giving it back to the OS "
              "after every free, so each step's activations and gradients do not page-fault in again (same peak RSS, "
              "faster steps; ``retain_freed_cpu_memory``). Process-wide from setup to teardown (also undone when the "
              "run raises: ``release_freed_cpu_memory``); ``False`` leaves the allocator as it is. Applied only on the "
              "device type its threshold was measured on (CPU, ``DEVICE_TUNING``), never to GPU runs.")


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


# glibc mallopt parameters (malloc.h) and their documented defaults (mallopt(3)); glibc has no getter for them
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_GLIBC_DEFAULTS = {_M_MMAP_THRESHOLD: 128 * 1024, _M_TRIM_THRESHOLD: 128 * 1024}
_ENVIRONMENT = {_M_MMAP_THRESHOLD: ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
                _M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold")}
_holders = 0  # retain_freed_cpu_memory calls not yet released in this process


def _libc():
    """glibc's C library, or None where the setting does not exist (not Linux/glibc)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _threshold_before(option: int) -> int:
    """The threshold the process started with: the environment's (``MALLOC_*_THRESHOLD_`` or ``GLIBC_TUNABLES``,
    read by glibc at start-up) or glibc's default."""
    variable, tunable = _ENVIRONMENT[option]
    texts = [os.environ.get(variable)]
    texts += [item.partition("=")[2] for item in os.environ.get("GLIBC_TUNABLES", "").split(":")
              if item.partition("=")[0] == tunable]
    for text in reversed([t for t in texts if t]):  # both set: the tunable's
        try:
            return int(text, 0)
        except ValueError:
            continue
    return _GLIBC_DEFAULTS[option]


def retain_freed_cpu_memory(limit: int | None = None) -> bool:
    """Keep freed CPU memory in the process instead of handing it back to the OS after every free (glibc only).

    By default glibc serves blocks above a sliding threshold (up to 32 MB) with fresh ``mmap`` pages and returns
    memory above the heap top to the OS; a training step frees and re-allocates its activations and gradients
    every time, so each step page-faults them in again (up to a quarter of a small-model DPO step on this
    project's CPU machine). Raising both thresholds to ``limit`` (default: the CPU's measured value,
    ``device_tuning``) makes blocks below it reuse the process's heap: peak RSS stays the same (the next step
    reuses what the last one freed), but the process no longer shrinks after a peak.

    Process-wide until ``release_freed_cpu_memory`` is called as often as this succeeded (``PolicyModule`` calls
    it at teardown, or when the run raises). Returns whether glibc took both settings (False elsewhere)."""
    global _holders
    from lightalign.modules.training.device_tuning import tuned

    limit = tuned("retain_freed_cpu_memory_bytes", "cpu") if limit is None else limit
    libc = _libc()
    if libc is None:
        return False
    took = all([libc.mallopt(option, limit) for option in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD)])
    if took:
        _holders += 1
    return took


def release_freed_cpu_memory() -> bool:
    """Undo one successful ``retain_freed_cpu_memory``; the last undo puts both thresholds back to what the process
    started with (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``GLIBC_TUNABLES`` when set, else glibc's
    defaults, 128 KiB each). Returns whether the thresholds were put back (False while another holder keeps them).

    What the undo cannot restore, since glibc has no getter and no switch back: without those variables glibc
    starts with a *sliding* mmap threshold (raised up to 32 MB each time a mapped block is freed, the trim threshold
    following at twice it), and any ``mallopt`` of either threshold turns that sliding off for the rest of the
    process. After the undo both thresholds are fixed at 128 KiB: blocks above it are mapped and unmapped as they
    are allocated and freed, and freed memory above the heap top is returned to the OS at the next free."""
    global _holders
    if _holders == 0:
        return False
    _holders -= 1
    if _holders:
        return False
    libc = _libc()
    return libc is not None and all(
        [libc.mallopt(option, _threshold_before(option)) for option in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD)])
