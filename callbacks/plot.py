"""``PlotCurves``: draw the run's learning curves to ``<log_dir>/curves.png`` at the end of fit."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightalign.callbacks.run_folder import run_dir_of


class PlotCurves(L.Callback):
    """At the end of fit, the curves ``lightalign plot`` would draw for this run, as ``<run folder>/<filename>``.

    Reads what the CSVLogger (or TensorBoardLogger) of the run wrote. Needs matplotlib (``lightalign[plot]``);
    enabled without it, the run stops at the start, not at the end.

    Args:
        enabled: draw the PNG (the quickstart configs turn it on).
        metrics: metric names to draw; default: the method's usual selection (see ``lightalign.plotting``).
        filename: PNG name inside the run folder.
    """

    def __init__(self, enabled: bool = False, metrics: list[str] | None = None, filename: str = "curves.png") -> None:
        self.enabled, self.metrics, self.filename = enabled, metrics, filename
        self.last_path: Path | None = None
        self._log_dir: str | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.enabled or stage != "fit":
            return
        from lightalign.plotting import _require_matplotlib

        _require_matplotlib()
        self._log_dir = str(run_dir_of(trainer))  # all ranks (without RunFolder, log_dir broadcasts)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled or not trainer.is_global_zero or self._log_dir is None:
            return
        from lightalign.plotting import find_run_dir, plot_runs

        for logger in trainer.loggers:
            logger.save()  # flush metrics.csv / event files before reading them
        try:
            run_dir = find_run_dir(self._log_dir)
        except FileNotFoundError:
            rank_zero_warn(f"PlotCurves: no metrics.csv or TensorBoard events in {self._log_dir} (a CSVLogger or "
                           "TensorBoardLogger is needed); no curves drawn.")
            return
        self.last_path = run_dir / self.filename
        plot_runs([run_dir], metrics=self.metrics, out=self.last_path)
        rank_zero_info(f"Learning curves written to {self.last_path}")
