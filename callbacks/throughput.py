"""``TokenThroughput``: tokens/s and samples/s of training, in the progress bar and the logger."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch


def batch_tokens(batch: Any) -> int:
    """Non-padding tokens of a batch: ``attention_mask`` ones, or every input token of a padding-free batch."""
    if isinstance(batch, dict):
        if "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        if "input_ids" in batch:
            return int(batch["input_ids"].numel())
    return 0


def batch_samples(batch: Any) -> int:
    if isinstance(batch, dict):
        if "position_ids" in batch and "attention_mask" not in batch:
            return int((batch["position_ids"] == 0).sum())
        if "input_ids" in batch:
            return int(batch["input_ids"].shape[0])
    return 0


class TokenThroughput(L.Callback):
    """Measure ``train/tokens_per_sec`` and ``train/samples_per_sec`` over each optimizer step (all ranks).

    Tokens are the non-padding tokens the model processed. The figure is the step's tokens divided by the
    wall time since the previous optimizer step ended, so it includes data loading and the optimizer.
    """

    def __init__(self, prog_bar: bool = True) -> None:
        self.prog_bar = prog_bar
        self._tokens = 0
        self._samples = 0
        self._start: float | None = None
        self._step = -1

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()
        self._tokens = self._samples = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Modules whose loader batch is not what they train on (GRPO trains on buffered rollouts) say what they
        # trained through `last_batch_tokens` / `last_batch_samples`.
        self._tokens += getattr(pl_module, "last_batch_tokens", None) or batch_tokens(batch)
        self._samples += getattr(pl_module, "last_batch_samples", None) or batch_samples(batch)
        if trainer.global_step == self._step:  # still accumulating
            return
        self._step = trainer.global_step
        now = time.perf_counter()
        elapsed = max(now - (self._start or now), 1e-9)
        counts = torch.tensor([self._tokens, self._samples], dtype=torch.float64, device=pl_module.device)
        counts = trainer.strategy.reduce(counts, reduce_op="sum") if trainer.world_size > 1 else counts
        pl_module.log("train/tokens_per_sec", counts[0].item() / elapsed, on_step=True, prog_bar=self.prog_bar)
        pl_module.log("train/samples_per_sec", counts[1].item() / elapsed, on_step=True)
        self._tokens = self._samples = 0
        self._start = now
