"""What TRL's GRPOTrainer passes every reward function besides the data: ``trainer_state``, ``log_extra`` and
``log_metric``, so that a reward function written for TRL runs here unchanged.

TRL 1.16 (``GRPOTrainer._calculate_rewards``) passes ``trainer_state=self.state`` (transformers' ``TrainerState``,
read for reward schedules: ``global_step``, ``epoch``, ``max_steps``), ``log_extra(column, values)`` (the values,
one per completion of the call, become a column of the logged completions table) and ``log_metric(name, value)``
(a scalar; the values of a logging step are averaged and logged beside the trainer's own metrics). Here the state is
``RewardTrainerState`` (those fields, read from the Lightning trainer at the rollout), the extra columns join the
sample table (``module.last_samples``, written by ``CompletionSamples``) and each metric is logged as
``train/<name>`` or ``val/<name>``, averaged like every statistic (``StatMetrics``).
"""

from __future__ import annotations

import math
import numbers
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from lightalign.rewards.calling import RewardFunctionError, short_repr

TRL_REWARD_KWARGS = ("trainer_state", "log_extra", "log_metric")


@dataclass(frozen=True)
class RewardTrainerState:
    """The fields of transformers' ``TrainerState`` a reward function reads, at the rollout being scored.

    ``global_step``: optimizer steps done; ``epoch``: the epoch in progress (``float``, as TRL's; whole here: the
    data epoch the rollout's prompts come from); ``max_steps``: the run's optimizer steps (``trainer.max_steps``,
    else the estimate from the epochs; -1 when unbounded); ``num_train_epochs``: ``trainer.max_epochs`` (-1 when
    unset); ``is_world_process_zero`` / ``is_local_process_zero``: whether this process is rank 0 (globally, on its
    node)."""

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = -1
    num_train_epochs: int = -1
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True

    @classmethod
    def of(cls, module: Any) -> "RewardTrainerState":
        """The state of ``module``'s fit (the defaults when it is not attached to a trainer)."""
        trainer = getattr(module, "_trainer", None)
        if trainer is None:
            return cls()
        max_steps = getattr(trainer, "max_steps", None)
        max_steps = max_steps if isinstance(max_steps, int) and max_steps >= 0 else -1
        if max_steps < 0:
            try:
                estimate = trainer.estimated_stepping_batches
                max_steps = int(estimate) if math.isfinite(estimate) else -1
            except Exception:  # noqa: BLE001 - no estimate before the data is known: unbounded, as documented
                max_steps = -1
        epochs = getattr(trainer, "max_epochs", None)
        return cls(global_step=int(getattr(trainer, "global_step", 0)),
                   epoch=float(getattr(trainer, "current_epoch", 0)), max_steps=max_steps,
                   num_train_epochs=int(epochs) if isinstance(epochs, int) else -1,
                   is_world_process_zero=bool(getattr(trainer, "is_global_zero", True)),
                   is_local_process_zero=int(getattr(trainer, "local_rank", 0)) == 0)


class RewardLogs:
    """What the reward functions of one scoring call log (they run on threads at once, hence the lock):
    ``log_extra`` and ``log_metric`` are the callables passed to them under TRL's names."""

    def __init__(self) -> None:
        self.extra: dict[str, list[Any]] = defaultdict(list)
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self._lock = threading.Lock()

    def log_extra(self, column: str, values: list[Any]) -> None:
        """Add ``values`` (one per completion of the call) as the column ``column`` of the completions table."""
        if not isinstance(column, str) or isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise TypeError(f"log_extra(column, values) takes a column name and a list of values, one per "
                            f"completion; got {short_repr(column)}, {short_repr(values)}.")
        with self._lock:
            self.extra[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        """Log the scalar ``value`` as the metric ``name`` (values of a logging step are averaged)."""
        if not isinstance(name, str) or not isinstance(value, numbers.Real):
            raise TypeError(f"log_metric(name, value) takes a metric name and a number; got {short_repr(name)}, "
                            f"{short_repr(value)}.")
        with self._lock:
            self.metrics[name].append(float(value))

    def kwargs(self, state: RewardTrainerState) -> dict[str, Any]:
        """The three keyword arguments TRL passes every reward function."""
        return {"trainer_state": state, "log_extra": self.log_extra, "log_metric": self.log_metric}

    def columns(self, n: int) -> dict[str, list[Any]]:
        """The extra columns, each checked to hold one value per completion of the rollout (``n``)."""
        for column, values in self.extra.items():
            if len(values) != n:
                raise RewardFunctionError(
                    f"log_extra('{column}', ...) was given {len(values)} values in all for a rollout of {n} "
                    "completions; a reward function logs one value per completion of its call, once per column.")
        return dict(self.extra)
