"""bf16 on the CPU: whether the CPU computes bf16 natively, the precision clause of the fit-start line, and the bound
on oneDNN's per-shape caches that keeps a bf16 run's memory from growing step after step.

Under ``bf16-mixed`` (and ``bf16-true``) on a CPU with native bf16 (AVX-512 BF16 or AMX), torch runs bf16 matrix
products through oneDNN, which builds a primitive (JIT kernels and their buffers, megabytes each) per operand shape
and keeps it in two caches, oneDNN's own (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's
(``LRU_CACHE_CAPACITY``), 1024 entries each by default. Padding-free rows, shared prefixes and per-sequence
attention give new shapes at almost every step, so the caches fill with primitives that are rarely used again and
the process grows until they are full: the float32 path (MKL's GEMM) keeps no such state. ``bound_onednn_caches``
sets both capacities to the ``onednn_primitive_cache_capacity`` of ``tuned``'s table when the user set neither. A
primitive built again for a shape computes what the evicted one computed (the same implementation is chosen for the
same shape), so the bound changes memory and the time spent building primitives, never a number.

Both variables are read once per process, at its first oneDNN bf16 primitive: the bound applies when it is set
before then (a run's ``setup`` on a fresh process) and cannot be taken back later, which is why it is set only for
runs that compute in bf16 on the CPU.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from lightalign.modules.training.device_tuning import tuned

CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's cache, ideep's cache
NATIVE_BF16_FLAGS = (("avx512_bf16", "AVX-512 BF16"), ("amx_bf16", "AMX-BF16"))  # /proc/cpuinfo flags -> names


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (``/proc/cpuinfo``); empty where that file does not exist."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(flags: frozenset[str] | None = None) -> list[str]:
    """The CPU's native bf16 instruction sets by name (AVX-512 BF16, AMX-BF16); empty if it has none (bf16 is then
    emulated, usually slower than float32)."""
    flags = cpu_flags() if flags is None else flags
    return [name for flag, name in NATIVE_BF16_FLAGS if flag in flags]


def computes_in_bf16(precision: object) -> bool:
    """Whether Lightning's ``precision`` (``"bf16-mixed"``, ``"bf16-true"``, a plugin's string …) computes in bf16."""
    return "bf16" in str(precision)


def precision_note(precision: object, device: torch.device, flags: frozenset[str] | None = None,
                   capability: str | None = None) -> str:
    """The fit-start line's clause on precision: which one runs and, on the CPU, whether the CPU computes bf16
    natively (its flags and torch's kernel level, ``torch.backends.cpu.get_cpu_capability``)."""
    note = f"precision {precision}"
    if device.type != "cpu":
        return note
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    native = native_bf16(flags)
    has = f"native bf16: {' + '.join(native)}" if native else "no native bf16 (emulated, slower than float32)"
    note += f" (CPU {capability}, {has}"
    if computes_in_bf16(precision) and native:
        limits = [os.environ.get(v) for v in CACHE_VARIABLES]
        note += f"; oneDNN caches {'/'.join(x or 'default' for x in limits)} primitives"
    return note + ")"


def bound_onednn_caches(device: torch.device) -> dict[str, str]:
    """Set oneDNN's and ideep's primitive-cache capacities for a bf16 run on ``device`` to the tuned bound, each
    only where the environment does not set it already; returns what was set (nothing off the CPU)."""
    capacity = tuned("onednn_primitive_cache_capacity", device)
    if capacity is None:
        return {}
    set_now = {name: str(capacity) for name in CACHE_VARIABLES if name not in os.environ}
    os.environ.update(set_now)
    return set_now
