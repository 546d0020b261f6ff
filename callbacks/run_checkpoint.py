"""``RunCheckpoint``: Lightning's ModelCheckpoint, plus ``last.ckpt`` at the final step of every run.

Lightning writes ``last.ckpt`` with the periodic checkpoints only (``every_n_train_steps``, epoch ends, validation),
so when ``max_steps`` is not a multiple of ``every_n_train_steps`` a finished run's ``last.ckpt`` stopped short of
its final steps: ``--ckpt_path last`` then trained those steps again instead of refusing a finished run
(``docs/runs.md``). Here ``last.ckpt`` is also written after the final optimizer step.

It is written at that step's batch end, where the periodic checkpoints are written, not at the end of training:
by then Lightning has closed the epoch, and a checkpoint of that state resumes (with a larger ``max_steps``) into an
epoch that ends after one batch — the next epoch's data order starts one epoch early.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` (same arguments) that also saves ``last`` (``save_last``) after the final step."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if self.save_last and final_step(trainer) and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            self._last_global_step_saved = trainer.global_step


def final_step(trainer: L.Trainer) -> bool:
    """The optimizer step that just ended is the run's last one (``max_steps`` reached, or the last batch of the
    last epoch when training by epochs)."""
    if trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step:
        return True
    max_epochs = trainer.max_epochs
    return bool(trainer.max_steps in (None, -1) and max_epochs is not None and max_epochs >= 0
                and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and trainer.current_epoch + 1 >= max_epochs)
