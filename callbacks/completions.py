"""``CompletionSamples``: a table of sample prompts, completions and rewards every N steps (CSV, TensorBoard)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning as L

from lightalign.callbacks.knob_range import check_at_least
from lightalign.runs import row_step, write_csv_atomically


class CompletionSamples(L.Callback):
    """Write ``max_rows`` of the latest rollout to ``<log_dir>/completions.csv`` every ``every_n_steps`` optimizer
    steps, and to TensorBoard as a markdown table when a ``TensorBoardLogger`` is attached.

    Works with any module that keeps ``last_samples`` (a list of dicts with ``step``, ``prompt``, ``completion``,
    ``reward`` and per-function rewards), as ``GRPOModule`` does.
    """

    def __init__(self, every_n_steps: int = 10, max_rows: int = 8, filename: str = "completions.csv") -> None:
        check_at_least("completions", "every_n_steps", every_n_steps, 1, "the optimizer steps between two tables")
        check_at_least("completions", "max_rows", max_rows, 1, "the rows of each table")
        self.every_n_steps, self.max_rows, self.filename = every_n_steps, max_rows, filename
        self._last_step = -1
        self._log_dir: str | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # trainer.log_dir broadcasts from rank 0 (a collective): read it here, where every rank runs, never in the
        # rank-0-only writes below (under DDP the other ranks would wait at their next collective forever)
        self._log_dir = trainer.log_dir or trainer.default_root_dir

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and trainer.global_step > 0:
            drop_rows_after(self.path(trainer), trainer.global_step)

    def path(self, trainer: L.Trainer) -> Path:
        return Path(self._log_dir or trainer.default_root_dir) / self.filename

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        samples = getattr(pl_module, "last_samples", None)
        if not samples or step == self._last_step or step % self.every_n_steps or not trainer.is_global_zero:
            return
        self._last_step = step
        rows = [dict(r, step=step) for r in samples[: self.max_rows]]
        path = self.path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                writer.writeheader()
            writer.writerows(rows)
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if type(logger).__name__ == "TensorBoardLogger" and hasattr(experiment, "add_text"):
                header = "| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]) + "\n"
                body = "".join("| " + " | ".join(_cell(v) for v in r.values()) + " |\n" for r in rows)
                experiment.add_text("completions", header + body, global_step=step)


def drop_rows_after(path: Path, step: int) -> int:
    """A resumed run continues the table: the rows the interrupted run wrote after its checkpoint (``step``) are
    dropped, since the resumed run samples and writes those steps again (as ``metrics.csv`` is continued). The file
    is rewritten atomically (temp file + rename). Returns the rows dropped."""
    if not path.is_file():
        return 0
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fieldnames, rows = list(reader.fieldnames or []), list(reader)
    kept = [r for r in rows if (logged := row_step(r)) is not None and logged <= step]
    if len(kept) < len(rows):
        write_csv_atomically(path, fieldnames, kept)
    return len(rows) - len(kept)


def _cell(value: Any) -> str:
    """A markdown table cell: pipes escaped, every kind of line break (``\\r``, ``\\u2028`` … which generated text can
    hold, not only ``\\n``) turned into a space, so a row stays one line."""
    return " ".join(str(value).replace("|", "\\|").splitlines())
