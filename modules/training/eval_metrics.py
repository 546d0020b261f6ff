"""The user's extra validation/test metrics: the knob (``EvalMetricsKnobs``) and ``PolicyModule``'s eval-metrics
seam (``EvalMetrics``: feed them per batch, log them per validation)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torchmetrics import Metric

from lightalign.knobs import KnobGroup, knob


@dataclasses.dataclass(frozen=True)
class EvalMetricsKnobs(KnobGroup):
    group = "eval_metrics"
    eval_metrics: dict[str, Metric | Callable] | None = knob(
        None, "extra validation/test metrics, logged as ``val/<name>``: torchmetrics objects (YAML ``class_path: "
              "torchmetrics.classification.BinaryAccuracy``) or callables ``fn(preds, target) -> float`` (averaged "
              "over batches, weighted by batch size). Each method says what ``preds``/``target`` are.", saved=False)

    def check(self) -> None:
        for name, fn in (self.eval_metrics or {}).items():
            if not isinstance(fn, Metric) and not callable(fn):
                raise TypeError(f"eval_metrics['{name}'] must be a torchmetrics Metric or a callable, got "
                                f"{type(fn).__name__}.")


class EvalMetrics:
    """Torchmetrics objects are submodules (moved, synced and reset by Lightning); plain callables are averaged here,
    weighted by batch size, and reduced over ranks."""

    def build_eval_metrics(self) -> None:
        metrics = dict(self.knobs.eval_metrics.eval_metrics or {})
        self.eval_metric_objects = torch.nn.ModuleDict({k: v for k, v in metrics.items() if isinstance(v, Metric)})
        self.eval_metric_fns = {k: v for k, v in metrics.items() if not isinstance(v, Metric)}
        self._eval_fn_totals: dict[str, list[float]] = {}

    def update_eval_metrics(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Feed the user's ``eval_metrics`` with one batch of predictions and targets."""
        for metric in self.eval_metric_objects.values():
            metric.update(preds, target)
        n = float(target.shape[0]) if target.ndim else 1.0
        for name, fn in self.eval_metric_fns.items():
            value = float(torch.as_tensor(fn(preds, target)).float().mean())
            total = self._eval_fn_totals.setdefault(name, [0.0, 0.0])
            total[0] += value * n
            total[1] += n

    def log_eval_metrics(self, stage: str) -> None:
        for name, metric in self.eval_metric_objects.items():
            self.log(f"{stage}/{name}", metric.compute())
            metric.reset()
        for name, (weighted, n) in self._eval_fn_totals.items():
            value = torch.tensor([weighted, n], dtype=torch.float64, device=self.device)
            if self._trainer is not None and self.trainer.world_size > 1:
                value = self.trainer.strategy.reduce(value, reduce_op="sum")
            self.log(f"{stage}/{name}", float(value[0] / value[1].clamp(min=1)))
        self._eval_fn_totals = {}
