"""``StepProgressBar``: Lightning's tqdm bar with the learning rate, and one line every N steps in log files."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from lightalign.callbacks.knob_range import check_at_least


class StepProgressBar(TQDMProgressBar):
    """The progress bar shows what the module puts there (loss, tokens/s, GRPO's reward mean) plus ``lr``.

    When stdout is not a terminal (CI, SLURM, ``> log.txt``) a redrawn bar would flood the log, so instead one
    line is printed every ``log_every_n_steps`` optimizer steps (default: about 20 lines per run) and one per
    validation: ``step 100/300 | train/loss 1.284 | lr 2.9e-03 | train/tokens_per_sec 4210 | 0:00:12``.

    Args:
        refresh_rate: tqdm refresh rate (interactive bar).
        log_every_n_steps: lines in non-interactive logs, every N optimizer steps (None: max_steps / 20).
        interactive: force the tqdm bar (True) or the line log (False); None: tqdm only on a terminal.
    """

    def __init__(self, refresh_rate: int = 1, log_every_n_steps: int | None = None,
                 interactive: bool | None = None) -> None:
        check_at_least("progress_bar", "refresh_rate", refresh_rate, 0, "the batches between two redraws of the bar "
                       "(0: no bar)")
        check_at_least("progress_bar", "log_every_n_steps", log_every_n_steps, 1, "the optimizer steps between two "
                       "progress lines in a log file (unset: max_steps / 20)", optional=True)
        super().__init__(refresh_rate=refresh_rate)
        self.log_every_n_steps = log_every_n_steps
        self.interactive = interactive
        self._lines = False
        self._last_line_step = -1
        self._start = 0.0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._start = time.perf_counter()  # `lightalign validate`'s lines count from here; a fit's from train start
        interactive = self.interactive if self.interactive is not None else sys.stdout.isatty()
        if not interactive and trainer.is_global_zero:
            self.disable()  # no tqdm output; the hooks below print lines instead
            self._lines = True

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        used = items.pop("train/lr", None)  # TokenThroughput's: the lr the step used, shown once as `lr`
        if used is not None:
            items["lr"] = f"{float(used):.2e}"
        elif trainer.optimizers:
            items["lr"] = f"{trainer.optimizers[0].param_groups[0]['lr']:.2e}"
        return items

    def every(self, trainer: L.Trainer) -> int:
        if self.log_every_n_steps is not None:
            return self.log_every_n_steps
        return max(1, trainer.max_steps // 20) if trainer.max_steps and trainer.max_steps > 0 else 50

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = trainer.global_step
        if not self._lines or step == 0 or step == self._last_line_step:  # step 0: still accumulating the first
            return
        last = trainer.max_steps is not None and step == trainer.max_steps
        if step % self.every(trainer) == 0 or step == 1 or last:
            self._last_line_step = step
            self.print_line(trainer, pl_module, {k: v for k, v in self.get_metrics(trainer, pl_module).items()
                                                 if not k.startswith(("val/", "test/"))})

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._lines and not trainer.sanity_checking:
            self.print_line(trainer, pl_module, {k: v for k, v in self.get_metrics(trainer, pl_module).items()
                                                 if k.startswith("val/")}, prefix="validation ")

    def print_line(self, trainer: L.Trainer, pl_module: L.LightningModule, items: dict[str, Any],
                   prefix: str = "") -> None:
        total = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
        fields = [f"{prefix}step {trainer.global_step}{total}"]
        fields += [f"{k} {_fmt(v)}" for k, v in items.items()]
        fields.append(str(timedelta(seconds=int(time.perf_counter() - self._start))))
        print(" | ".join(fields), flush=True)


def _fmt(value: Any) -> str:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)
