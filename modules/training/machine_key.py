"""What a CPU timing depends on, as one key: the kernels torch dispatches to (its CPU capability, which
``ATEN_CPU_CAPABILITY`` lowers), oneDNN's ISA cap (``ONEDNN_MAX_CPU_ISA``), the CPU's bf16 and AMX flags, torch's
version and the intra-op thread count. A constant tuned by timing on one key is not assumed right on another
(``device_tuning.tuned``); a verdict measured on this machine is cached under its key (``key_id``)."""

from __future__ import annotations

import functools
import hashlib
import json
import os

import torch

_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")  # /proc/cpuinfo flags that change which bf16 / matmul kernels run


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> tuple[str, ...]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    present = set(line.split(":", 1)[1].split())
                    return tuple(flag for flag in _FLAGS if flag in present)
    except OSError:
        pass  # no /proc (macOS, Windows): the flags are unknown, and the key says so
    return ("unknown",)


def machine_key() -> dict:
    """This process's key: the facts a CPU timing depends on (recomputed each call: the thread count and the
    environment can change within a process)."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL"
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "onednn_max_isa": isa.upper(),
            "cpu_flags": list(_cpu_flags()), "torch": torch.__version__.split("+")[0],
            "threads": torch.get_num_threads()}


def key_id(key: dict) -> str:
    """A short stable name for ``key`` (the cache file's name)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def describe(key: dict) -> str:
    """``key`` in a few words, e.g. ``AVX512, oneDNN ALL, avx512_bf16+amx_tile, torch 2.13.0, 2 threads``."""
    flags = "+".join(key["cpu_flags"]) or "no bf16/AMX flags"
    return (f"{key['cpu_capability']}, oneDNN {key['onednn_max_isa']}, {flags}, torch {key['torch']}, "
            f"{key['threads']} threads")
