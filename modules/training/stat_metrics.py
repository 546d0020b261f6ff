"""``StatMetrics``: a method's per-stage statistics, one ``MeanMetric`` per name, logged as ``<stage>/<name>``.

Each statistic is averaged over what a stage saw (the micro-batches of an optimizer step, or a validation epoch)
and logged once, then reset; a statistic nothing updated is not logged.

Training statistics cost a Lightning ``self.log`` call each (Lightning copies its result entry on every call; measured,
see docs/performance.md 'Logged statistics'), about 20 per online-DPO step and more for GRPO. A statistic nothing reads
at every step is logged only on the optimizer steps whose metrics the loggers write (Lightning's ``log_every_n_steps``),
the steps where it would have reached a file or a dashboard anyway: what the loggers receive is unchanged. Read at every
step, and so logged at every step: the progress bar's statistics, the run summary's (its final and best values), and any
callback's ``monitor`` (``ModelCheckpoint``, ``EarlyStopping``); every statistic at the fit's last step (the model
card's and ``trainer.callback_metrics``' final values). On the other steps ``trainer.callback_metrics`` holds the other
statistics' values of the last written step (with or without a logger: the steps are Lightning's ``log_every_n_steps``;
``log_every_n_steps: 1`` logs every statistic at every step).
"""

from __future__ import annotations

import warnings
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
        self.metric_kwargs = metric_kwargs

    def add(self, name: str) -> MeanMetric:
        """The metric of ``name``, created (on the device of the others) when a statistic first appears during the
        run: what reward functions log with ``log_metric``."""
        key = metric_key(name)
        if key not in self:
            existing = next(iter(self.values()), None)
            metric = MeanMetric(**self.metric_kwargs)
            self[key] = metric.to(existing.device) if existing is not None else metric
            self.names[key] = name
        return self[key]

    def log(self, module: Any, stage: str, prog_bar: Iterable[str] = (), only: Iterable[str] | None = None) -> None:
        """``module.log`` each updated statistic as ``<stage>/<name>`` (with ``only``, just those named there);
        reset them all. Under ``torch.distributed`` a statistic updated on any rank is logged on every rank
        (``updated_on_any_rank``)."""
        prog_bar, only = set(prog_bar), None if only is None else set(only)
        updated = self.updated_on_any_rank()
        for key in sorted(self.keys()) if self.distributed() else list(self.keys()):  # one order on every rank
            metric, name = self[key], self.names[key]
            if key in updated and (only is None or name in only):
                if metric.update_called:
                    value = metric.compute()
                else:  # updated on another rank only: its value comes with the sync
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message=".*was called before the ``update`` method.*")
                        value = metric.compute()
                module.log(f"{stage}/{name}", value, prog_bar=name in prog_bar)
            metric.reset()

    @staticmethod
    def distributed() -> bool:
        dist = torch.distributed
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def updated_on_any_rank(self) -> set[str]:
        """The keys of the statistics some rank updated. ``compute`` is a collective over the ranks, so every rank
        must compute the same statistics in the same order: a statistic one rank never saw (a reward function's
        ``log_metric`` on that rank's completions only, a tool statistic of a rank whose rollout made no call) would
        otherwise pair one rank's ``compute`` with another's next one, or leave a rank waiting for good. One rank:
        the statistics it updated."""
        dist = torch.distributed
        if not self.distributed():
            return {key for key, metric in self.items() if metric.update_called}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(self.names.items()))
        for pairs in everyone:
            for key, name in pairs:
                if key not in self:
                    self.add(name)
        keys = list(self.keys())
        device = next(iter(self.values())).device if dist.get_backend() != "gloo" else torch.device("cpu")
        flags = torch.tensor([float(self[k].update_called) for k in keys], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return {key for key, flag in zip(keys, flags.tolist()) if flag}


def loggers_write_this_step(trainer: Any) -> bool:
    """Whether the optimizer step in progress is one whose training metrics the loggers write (Lightning's rule:
    every ``log_every_n_steps``-th step, the step the trainer stops at, every step of ``fast_dev_run``; the same
    steps when the run has no logger), or the fit's last step (so that ``trainer.callback_metrics`` after fit, the
    model card's final metrics, hold every statistic's last value). Asked before the step's optimizer update, as
    ``on_before_optimizer_step``."""
    if trainer.fast_dev_run or trainer._logger_connector.should_update_logs:
        return True
    if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step + 1 >= trainer.max_steps:
        return True
    epochs = trainer.max_epochs
    return bool(trainer.is_last_batch) and epochs is not None and epochs >= 0 and trainer.current_epoch + 1 >= epochs


def read_every_step(trainer: Any, module: Any, stage: str = "train") -> set[str]:
    """The ``stage`` statistics something reads at every optimizer step: the progress bar's
    (``module.progress_stats``), the run summary's (``summary_keys``) and any callback's
    ``monitor`` under ``<stage>/``."""
    from lightalign.callbacks.summary import summary_keys

    names = set(getattr(module, "progress_stats", ())) | set(summary_keys(module))
    for callback in trainer.callbacks:
        monitor = getattr(callback, "monitor", None)
        if isinstance(monitor, str) and monitor.startswith(stage + "/"):
            names.add(monitor[len(stage) + 1:])
    return names
