"""``RunFolder``: the one folder a CLI run writes everything into (rules in ``lightalign.runs``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightalign.runs import CHECKPOINT_FACTS_KEY, checkpoint_facts, folder_logger, new_run_folder, runs_root


class RunFolder(L.Callback):
    """Decide the run folder at setup (every rank: it is broadcast from rank 0) and point the checkpoints there;
    ``resume`` (set by the CLI) is the folder a resumed run continues. Each checkpoint records the facts a resume
    is checked against (``lightalign.runs.check_resume``).

    The other callbacks find the folder with ``run_dir_of(trainer)``.
    """

    def __init__(self) -> None:
        self.path: Path | None = None
        self.resume: Path | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.path is not None:
            return
        logger = folder_logger(trainer)
        if isinstance(logger, (CSVLogger, TensorBoardLogger)):
            path = trainer.strategy.broadcast(logger.log_dir)  # the logger numbers its versions (pinned on resume)
        else:
            path = None
            if trainer.is_global_zero:
                path = str(self.resume) if self.resume is not None else str(new_run_folder(runs_root(trainer)))
            path = trainer.strategy.broadcast(path)
        self.path = Path(path)
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = str(self.path / "checkpoints")
        if trainer.is_global_zero:
            self.path.mkdir(parents=True, exist_ok=True)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_FACTS_KEY] = checkpoint_facts(trainer, pl_module, trainer.datamodule, self.path)


def run_dir_of(trainer: L.Trainer) -> Path:
    """The run folder: RunFolder's (the CLI), else the trainer's ``log_dir`` (a collective: call it on every rank)."""
    for callback in trainer.callbacks:
        if isinstance(callback, RunFolder) and callback.path is not None:
            return callback.path
    return Path(trainer.log_dir or trainer.default_root_dir)
