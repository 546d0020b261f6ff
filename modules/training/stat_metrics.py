"""``StatMetrics``: a method's per-stage statistics, one ``MeanMetric`` per name, logged as ``<stage>/<name>``.

Each statistic is averaged over what a stage saw (the micro-batches of an optimizer step, or a validation epoch)
and logged once, then reset; a statistic nothing updated is not logged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torchmetrics.aggregation import MeanMetric


def metric_key(name: str) -> str:
    """A metric name as a ``ModuleDict`` key (no dots or slashes)."""
    return name.replace("/", "__").replace(".", "_")


class StatMetrics(torch.nn.ModuleDict):
    """The metrics of one stage, keyed by ``metric_key(name)`` (index them with it), in the order of ``names``."""

    def __init__(self, names: Iterable[str], **metric_kwargs: Any) -> None:
        names = list(names)
        super().__init__({metric_key(n): MeanMetric(**metric_kwargs) for n in names})
        self.names = {metric_key(n): n for n in names}

    def log(self, module: Any, stage: str, prog_bar: Iterable[str] = ()) -> None:
        """``module.log`` each updated statistic as ``<stage>/<name>``; reset them all."""
        for key, metric in self.items():
            if metric.update_called:
                name = self.names[key]
                module.log(f"{stage}/{name}", metric.compute(), prog_bar=name in prog_bar)
            metric.reset()
