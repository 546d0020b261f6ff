"""``RunCheckpoint``: Lightning's ModelCheckpoint, plus ``last.ckpt`` at the final step of every run, and each
step's checkpoint written after that step's validation.

Lightning writes ``last.ckpt`` with the periodic checkpoints only (``every_n_train_steps``, epoch ends, validation),
so when ``max_steps`` is not a multiple of ``every_n_train_steps`` a finished run's ``last.ckpt`` stopped short of
its final steps: ``--ckpt_path last`` then trained those steps again instead of refusing a finished run
(``docs/runs.md``). Here ``last.ckpt`` is also written after the final optimizer step.

It is written at that step's batch end, where the periodic checkpoints are written, not at the end of training:
by then Lightning has closed the epoch, and a checkpoint of that state resumes (with a larger ``max_steps``) into an
epoch that ends after one batch — the next epoch's data order starts one epoch early.

A step after which a validation runs (``val_check_interval``, the epoch's end) is checkpointed once that validation
has ended, not at its batch end: Lightning resumes a checkpoint written at a batch end without the validation that
was due after that batch, so a run killed between the two never validated that step (its ``val/*`` row missing for
good). Written after it, the checkpoint holds the state the next step starts from, and Lightning resumes it as
it resumes a checkpoint written at a validation's end: with the next training step. A kill before then resumes from
the previous checkpoint and runs the validation again.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightalign.callbacks.knob_range import check_at_least

#: ModelCheckpoint's numeric knobs and their ranges (as Lightning checks them), with what each means.
RANGES = (("every_n_train_steps", 0, "the optimizer steps between two checkpoints (0: none by steps)"),
          ("every_n_epochs", 0, "the epochs between two checkpoints (0: none by epochs)"),
          ("save_top_k", -1, "the best checkpoints kept (-1: all, 0: only last.ckpt)"))


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` (same arguments) that also saves ``last`` (``save_last``) after the final step, and saves
    a step that is followed by a validation after it."""

    _after_validation: tuple[Any, ...] | None = None  # the batch-end arguments of a step whose save waits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # ModelCheckpoint's own range checks raise a MisconfigurationException from inside Lightning, which the
        # console prints as a traceback; these name the console option (--checkpoint.*) in one line first
        for knob, minimum, meaning in RANGES:
            check_at_least("checkpoint", knob, kwargs.get(knob), minimum, meaning, optional=True)
        super().__init__(*args, **kwargs)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        if validation_follows(trainer):
            self._after_validation = args
            return
        self._save_at_step_end(trainer, pl_module, *args)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        waiting, self._after_validation = self._after_validation, None
        if waiting is not None and not trainer.sanity_checking:
            self._save_at_step_end(trainer, pl_module, *waiting)
        super().on_validation_end(trainer, pl_module)

    def _save_at_step_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        if self.save_last and final_step(trainer) and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            self._last_global_step_saved = trainer.global_step


def validation_follows(trainer: L.Trainer) -> bool:
    """Whether Lightning validates right after the training batch that just ended (its own test, asked at the
    batch end; a time-based ``val_check_interval`` may still become due by then, which only leaves that save at the
    batch end). The validation data is set up first (as the validation would), so that a run whose validation
    has no batches counts as not validating."""
    if trainer.sanity_checking or not trainer.training:
        return False
    loop = trainer.fit_loop.epoch_loop
    data_fetcher = trainer.fit_loop._data_fetcher
    if data_fetcher is None or not loop._should_check_val_fx(data_fetcher):
        return False
    loop.val_loop.setup_data()
    return not loop.val_loop.skip


def final_step(trainer: L.Trainer) -> bool:
    """The optimizer step that just ended is the run's last one (``max_steps`` reached, or the last batch of the
    last epoch when training by epochs)."""
    if trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step:
        return True
    max_epochs = trainer.max_epochs
    return bool(trainer.max_steps in (None, -1) and max_epochs is not None and max_epochs >= 0
                and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and trainer.current_epoch + 1 >= max_epochs)
