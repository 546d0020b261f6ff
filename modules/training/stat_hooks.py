"""``StatHooks``: the Lightning hooks of a module whose every stage runs one ``_step(batch, stats)``.

DPO, KTO and reward models train and evaluate on fixed data the same way: each batch goes through ``_step`` with
the stage's torchmetrics (``train_stats`` or ``eval_stats``), the training statistics are logged once per optimizer
step (aggregated over the accumulated micro-batches and the ranks), and the evaluation statistics once per
validation or test epoch, with the ``eval_metrics``. The module supplies ``_step`` and names its statistics in
``logged_stats`` (``build_stat_metrics`` makes a weighted mean of each per stage; ``_log_stats`` logs them as
``<stage>/<name>``, the ``progress_stats`` on the progress bar); a module with other logging overrides ``_log_stats``.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics.aggregation import MeanMetric

__all__ = ["StatHooks"]


class StatHooks:
    """Mix in before ``PolicyModule``: ``class DPOModule(StatHooks, PolicyModule)``."""

    logged_stats: tuple[str, ...] = ()  # what ``_step`` updates, logged as ``train/<name>``, ``val/<name>``
    progress_stats: tuple[str, ...] = ("loss", "rewards/accuracies")  # shown on the progress bar

    def build_stat_metrics(self) -> None:
        """``train_stats`` and ``eval_stats``: a weighted mean (``MeanMetric``) per name of ``logged_stats``."""
        self.train_stats = torch.nn.ModuleDict({k.replace("/", "_"): MeanMetric() for k in self.logged_stats})
        self.eval_stats = torch.nn.ModuleDict({k.replace("/", "_"): MeanMetric() for k in self.logged_stats})

    def _log_stats(self, stats: torch.nn.ModuleDict, stage: str) -> None:
        for key in self.logged_stats:
            metric = stats[key.replace("/", "_")]
            self.log(f"{stage}/{key}", metric.compute(), prog_bar=key in self.progress_stats)
            metric.reset()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)  # type: ignore[misc]
        self._log_stats(self.train_stats, "train")

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._step(batch, self.eval_stats)

    def on_validation_epoch_end(self) -> None:
        self._log_stats(self.eval_stats, "val")
        self.log_eval_metrics("val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._step(batch, self.eval_stats)

    def on_test_epoch_end(self) -> None:
        self._log_stats(self.eval_stats, "test")
        self.log_eval_metrics("test")
