"""A fit as a run of its run folder (``lightalign.runs``): ``fit_run`` claims the folder before anything is written
into it and gives it back when the fit ends, and resolves ``--ckpt_path`` (``prepare_resume``: ``last``, a
checkpoint, a run folder), checked against the config before anything loads. The console script
(``LightalignCLI.fit``) and ``lightalign.Trainer.fit(..., ckpt_path="last")`` both fit through it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import lightning as L
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightalign.callbacks import HFExport, RunFolder
from lightalign.quiet import exact_resume_quiet
from lightalign.runs import (ResumeError, RunError, callback_of, check_resume, checkpoint_in, continue_logs,
                             discard_empty_run_folder, folder_logger, latest_run, pin_version, read_checkpoint,
                             run_of_checkpoint, runs_root, version_of)


def fit_run(trainer: L.Trainer, fit: Callable[..., None], module: L.LightningModule, datamodule: Any,
            ckpt_path: str | os.PathLike | None, **kwargs: Any) -> None:
    """``fit(module, datamodule=..., ckpt_path=..., **kwargs)`` (a Trainer's own ``fit``) as a run of a run folder:
    a ``ckpt_path`` other than Lightning's ``best``/``hpc``/``registry`` is resolved and checked by
    ``prepare_resume`` first; the run folder is claimed for this run before anything is written into it
    (``RunFolder.take``: a folder another live run owns is refused) and given back when the fit ends; a new run
    refused before writing anything leaves no empty ``version_N`` (``discard_empty_run_folder``)."""
    if trainer.max_steps == 0:  # Lightning would stop at once and the export write the untrained model
        raise RunError("--trainer.max_steps is 0 (max_steps=0): there is nothing to train. Set it to the number of "
                       "optimizer steps to run (or -1 with --trainer.max_epochs to train by epochs).")

    folder = callback_of(trainer, RunFolder)
    logger = folder_logger(trainer)
    versioned = isinstance(logger, (CSVLogger, TensorBoardLogger))
    numbered = versioned and logger._version is None  # the logger picks the next version_N itself
    try:
        if ckpt_path is not None and str(ckpt_path) not in ("best", "hpc", "registry"):
            ckpt_path = prepare_resume(trainer, str(ckpt_path), module, datamodule)  # claims the run it continues
        if folder is not None and folder.resume is None and folder.refusal is None and versioned:
            folder.take(trainer, Path(logger.log_dir), numbered, new_run=True)  # before the logger's first write
        try:
            with exact_resume_quiet(datamodule):  # Lightning's "dataloader not resumable": false for lightalign's data
                fit(module, datamodule=datamodule, ckpt_path=ckpt_path, **kwargs)
        except Exception:
            if folder is None or (folder.resume is None and folder.refusal is None):
                if folder is not None:
                    folder.release()  # the lock file first: then an empty version_N is removed
                discard_empty_run_folder(trainer)
            raise
    finally:
        if folder is not None:
            folder.release()


def prepare_resume(trainer: L.Trainer, ckpt_path: str, module: L.LightningModule, datamodule: Any) -> str | None:
    """The checkpoint to load for ``ckpt_path`` (``last``: the newest run's ``last.ckpt``; None: no such run, start
    fresh), checked against the module and data (``check_resume``); when it lies in a run folder of this Trainer's,
    that folder is continued: the logger's version is pinned to it, the trainer's ``RunFolder`` points there and the
    logged metrics continue after the checkpoint's step (``continue_logs``). A checkpoint at ``max_steps`` is refused
    unless the run's Hugging Face export is still missing (the run was killed while writing it): then only that is
    written."""
    root = runs_root(trainer)
    if ckpt_path == "last":
        run = latest_run(root)
        if run is None:
            rank_zero_info(f"--ckpt_path last: no earlier run of this config has a checkpoint (no "
                           f"{root}/version_N/checkpoints/last.ckpt): starting a new run.")
            return None
        path = run / "checkpoints" / "last.ckpt"
    else:
        path = checkpoint_in(Path(ckpt_path))
        run = run_of_checkpoint(path, root) if path.is_file() else None
    folder = callback_of(trainer, RunFolder)
    if run is not None and folder is not None and not folder.take(trainer, run):
        return None  # refused while the other ranks already run: raised on every rank at setup, nothing loaded
    checkpoint = read_checkpoint(path)
    for warning in check_resume(checkpoint, path, trainer, module, datamodule):
        rank_zero_warn(warning)
    step = int(checkpoint.get("global_step", 0))
    if step == trainer.max_steps:
        export = callback_of(trainer, HFExport)
        # a checkpoint outside this config's run folders starts a new folder, where no export exists yet
        target = None if export is None else Path(export.output_dir) if export.output_dir \
            else run / "hf_model" if run else None
        if export is None or not export.enabled or (target is not None and target.exists()):
            raise ResumeError(f"Checkpoint '{path}' is at step {step} = --trainer.max_steps: that run is finished. "
                              f"Raise --trainer.max_steps above {step} to train further.")
        rank_zero_info(f"Checkpoint '{path}' is at --trainer.max_steps ({step}): nothing left to train; writing "
                       f"the Hugging Face export the interrupted run did not finish ({target or 'in a new run folder'}).")
    del checkpoint
    if run is not None:
        pin_version(trainer, version_of(run))
        if folder is not None:
            folder.resume = run
        dropped = continue_logs(trainer, step) if rank_zero_only.rank == 0 else 0
        rank_zero_info(f"Continuing run {run} from step {step} ({path.name})" + (
            f"; {dropped} metric rows the interrupted run logged after that step are dropped." if dropped else "."))
    return str(path)
