"""``TokenThroughput``: tokens/s, samples/s, FLOP/s and MFU of training, and the learning rate, in the progress bar
and the logger."""

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


def training_flops_per_token(num_params: int, num_layers: int = 0, hidden_size: int = 0, seq_len: float = 0.0) -> float:
    """Training FLOPs per token: ``6 * params`` (forward 2N, backward 4N) plus, when the shape is given, the
    attention score/value products ``12 * layers * hidden * seq_len`` (the PaLM paper's MFU accounting)."""
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_len


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

    Also logged: ``train/tflops_per_sec`` (all ranks; :func:`training_flops_per_token` times tokens/s, the
    model's parameter count and shape read at the start of training), ``train/mfu`` when ``peak_flops`` (the
    peak FLOP/s of one device at the training precision, e.g. ``989e12`` for an H100 in bf16) is given, and
    ``train/lr`` (first parameter group) in the progress bar when ``show_lr``.
    """

    def __init__(self, prog_bar: bool = True, peak_flops: float | None = None, show_lr: bool = True) -> None:
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"--throughput.peak_flops {peak_flops}: must be a number > 0 (or unset); it is one "
                             "device's peak FLOP/s at the training precision (e.g. 989e12 for an H100 in bf16).")
        self.prog_bar = prog_bar
        self.peak_flops = peak_flops
        self.show_lr = show_lr
        self._shape = (0, 0, 0)
        self._lr: float | None = None
        self._tokens = 0
        self._samples = 0
        self._start: float | None = None
        self._step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the clock and the step start here too: a run resumed mid-epoch gets no on_train_epoch_start (its first
        # step would be timed from no start at all), and the first micro-batches of a run are not a finished step
        self._start, self._step = time.perf_counter(), trainer.global_step
        self._tokens = self._samples = 0
        model = getattr(pl_module, "model", None) or pl_module
        config = getattr(model, "config", None)
        params = sum(p.numel() for p in model.parameters())
        self._shape = (params, int(getattr(config, "num_hidden_layers", 0) or 0), int(getattr(config, "hidden_size", 0) or 0))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._lr = float(optimizer.param_groups[0]["lr"])  # the step's lr (the schedule moves on right after)

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
        params, layers, hidden = self._shape
        if params:
            seq_len = counts[0].item() / max(counts[1].item(), 1.0)
            flops = training_flops_per_token(params, layers, hidden, seq_len) * counts[0].item() / elapsed
            pl_module.log("train/tflops_per_sec", flops / 1e12, on_step=True)
            if self.peak_flops is not None:
                pl_module.log("train/mfu", flops / (self.peak_flops * trainer.world_size), on_step=True, prog_bar=self.prog_bar)
        if self.show_lr and self._lr is not None:
            pl_module.log("train/lr", self._lr, on_step=True, prog_bar=self.prog_bar)
        self._tokens = self._samples = 0
        self._start = now
