"""``RunFolder``: the one folder a CLI run writes everything into (rules in ``lightalign.runs``), and its owner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info

from lightalign.run_lock import RunInUseError, RunLock
from lightalign.runs import (CHECKPOINT_FACTS_KEY, RunError, callback_of, checkpoint_facts, folder_logger,
                             new_run_folder, pin_version, runs_root, version_of)

#: What a run writes into its folder (metrics, checkpoints, export); a folder holding one of them holds a run.
RUN_OUTPUTS = ("metrics.csv", "checkpoints", "hf_model")


class RunFolder(L.Callback):
    """Decide the run folder at setup (every rank: it is broadcast from rank 0) and point the checkpoints there;
    ``resume`` (set by ``lightalign.run_fit.prepare_resume``) is the folder a resumed run continues. Each checkpoint
    records the facts a resume is checked against (``lightalign.runs.check_resume``).

    The run owns its folder (``lightalign.run_lock``): rank 0 claims it (``take``) before anything is written into it
    — ``fit_run`` does, before the logger starts, for a folder known then (a resume, a CSV/TensorBoard logger's
    ``version_N``); ``setup`` does for the others — and ``release`` gives it back at the end of the run. A refusal
    reaches every rank: it is broadcast at ``setup`` and raised there on each.

    The other callbacks find the folder with ``run_dir_of(trainer)``.
    """

    def __init__(self) -> None:
        self.path: Path | None = None
        self.resume: Path | None = None
        self.lock: RunLock | None = None
        self.refusal: str | None = None  # rank 0 was refused while the other ranks already ran: raised at setup

    def take(self, trainer: L.Trainer, folder: Path, numbered: bool = False, new_run: bool = False) -> bool:
        """Claim ``folder`` for this run on rank 0 (the other ranks belong to the run rank 0 claims for: True).

        ``numbered``: a new run's ``version_N`` that the CSV/TensorBoard logger numbered itself; if another run holds
        it, or it holds files already (another run took the number meanwhile), the next ``version_N`` is claimed and
        the logger pinned to it. ``new_run`` (not a resume) in a folder named explicitly that holds a run's outputs
        (``RUN_OUTPUTS``): refused, the logger would delete that run's metrics. Refused: raises ``RunInUseError``, or, where the other ranks were started apart from
        this process (torchrun, SLURM, one command per node) and wait for it, keeps the refusal for ``setup`` to
        raise on every rank, drops the loggers (nothing is written) and returns False; where they are yet to be
        started by this process (one node: Lightning starts them in ``fit``) there is none to tell."""
        if trainer.global_rank != 0 or self.lock is not None:
            return True
        while True:
            try:
                lock = RunLock.acquire(folder, info=rank_zero_info)
            except RunInUseError as err:
                if numbered:
                    folder = self._next_version(trainer, folder)
                    continue
                environment = getattr(trainer.strategy, "cluster_environment", None)  # other nodes: started apart
                if trainer.world_size > 1 and (trainer.num_nodes > 1 or
                                               getattr(environment, "creates_processes_externally", False)):
                    self.refusal = str(err)
                    trainer.loggers = []
                    return False
                raise
            if numbered and folder.is_dir() and any(folder.iterdir()):
                lock.release()
                folder = self._next_version(trainer, folder)
                continue
            held = [name for name in RUN_OUTPUTS if (folder / name).exists()] if new_run and not numbered else []
            if held:  # an explicit version_N of a finished or killed run: the logger would delete its metrics
                lock.release()
                raise RunError(f"{folder} holds a run already ({', '.join(held)}): a new run in it would replace "
                               "its metrics. Continue that run with --ckpt_path last, or leave "
                               "--trainer.logger.init_args.version unset (a new version_N) or name another one.")
            self.lock = lock
            return True

    @staticmethod
    def _next_version(trainer: L.Trainer, folder: Path) -> Path:
        version = version_of(folder) + 1
        pin_version(trainer, version)
        return folder.with_name(f"version_{version}")

    def release(self) -> None:
        """Give the run folder back (at the end of the run, also after an error); idempotent."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.path is not None:
            return
        logger = folder_logger(trainer)
        path, refusal = None, self.refusal
        if trainer.is_global_zero and refusal is None:
            if isinstance(logger, (CSVLogger, TensorBoardLogger)):
                path = logger.log_dir  # the logger numbers its versions (pinned on resume)
            else:
                path = str(self.resume) if self.resume is not None else str(new_run_folder(runs_root(trainer)))
            try:
                self.take(trainer, Path(path))  # claimed already by fit_run, except a folder decided here
            except RunInUseError as err:
                refusal = str(err)
        path, refusal = trainer.strategy.broadcast((path, refusal))
        if refusal is not None:
            raise RunInUseError(refusal, {})
        self.path = Path(path)
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = str(self.path / "checkpoints")
        if trainer.is_global_zero:
            self.path.mkdir(parents=True, exist_ok=True)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":  # validate/test (no fit_run, which releases a fit's claim once everything is written)
            self.release()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_FACTS_KEY] = checkpoint_facts(trainer, pl_module, trainer.datamodule, self.path)


def run_dir_of(trainer: L.Trainer) -> Path:
    """The run folder: RunFolder's (the CLI), else the trainer's ``log_dir`` (a collective: call it on every rank)."""
    folder = callback_of(trainer, RunFolder)
    if folder is not None and folder.path is not None:
        return folder.path
    return Path(trainer.log_dir or trainer.default_root_dir)
