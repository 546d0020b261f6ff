"""``DeviceCacheCleanup``: free the accelerator's cached memory every N optimizer steps (TRL's ``optimize_device_cache``)."""

from __future__ import annotations

import gc
from typing import Any

import lightning as L
import torch


def free_device_cache() -> bool:
    """Collect garbage and return the CUDA (or MPS) allocator's cached blocks to the device; False on CPU (no-op)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        return True
    mps = getattr(torch, "mps", None)
    if mps is not None and torch.backends.mps.is_available():
        gc.collect()
        mps.empty_cache()
        return True
    return False


class DeviceCacheCleanup(L.Callback):
    """Call :func:`free_device_cache` after every ``every_n_steps``-th optimizer step.

    Lowers peak reserved memory when batch shapes vary (generation, unpacked data) at a small speed cost.
    ``cleanups`` counts the calls; ``freed`` the ones that had an accelerator cache to free.
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        if every_n_steps < 1:
            raise ValueError(f"DeviceCacheCleanup(every_n_steps={every_n_steps}): use 1 or more.")
        self.every_n_steps = every_n_steps
        self.cleanups = 0
        self.freed = 0
        self._last_step = -1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step or step == 0 or step % self.every_n_steps:
            return  # still accumulating, or not a cleanup step
        self._last_step = step
        self.cleanups += 1
        self.freed += int(free_device_cache())
