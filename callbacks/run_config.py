"""``SaveRunConfig``: the resolved config and the package versions beside every run, so it can be reproduced."""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata
from pathlib import Path

import lightning as L
from lightning.pytorch.cli import SaveConfigCallback

from lightalign.callbacks.run_folder import run_dir_of

VERSIONED_PACKAGES = ("lightalign", "torch", "lightning", "transformers", "datasets", "tokenizers", "torchmetrics",
                      "jsonargparse", "peft", "deepspeed", "bitsandbytes", "accelerate", "numpy")


def package_versions() -> dict[str, str | None]:
    """Python, platform, CUDA and the installed versions of the packages a run depends on (None: not installed)."""
    import torch

    versions: dict[str, str | None] = {"python": platform.python_version(), "platform": platform.platform(),
                                       "cuda": torch.version.cuda}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["command"] = " ".join(sys.argv)
    return versions


def record_precision_ran(config, trainer: L.Trainer) -> None:
    """Make ``config``'s ``trainer.precision`` the precision Lightning runs, when it replaced the configured one
    (``16-mixed`` on CPU runs as ``bf16-mixed``): config.yaml records what ran, and says so in the log."""
    from lightning.fabric.connector import _convert_precision_to_unified_args
    from lightning.pytorch.utilities import rank_zero_info

    trainer_config = config.get("trainer") if hasattr(config, "get") else None
    if trainer_config is None or trainer_config.get("precision") is None:
        return
    asked, ran = trainer_config["precision"], str(trainer.precision)
    try:
        same = str(_convert_precision_to_unified_args(asked)) == ran
    except ValueError:
        return
    if not same:
        trainer_config["precision"] = ran
        rank_zero_info(f"config.yaml records trainer.precision {ran}, what ran ({asked} is not available on "
                       f"{type(trainer.accelerator).__name__.replace('Accelerator', '')}; Lightning switched it).")


class SaveRunConfig(SaveConfigCallback):
    """``config.yaml`` (what ``--print_config`` prints) and ``versions.json`` in the run folder, whatever the
    logger (``lightalign.runs``); with an MLFlowLogger or WandbLogger both files are also attached to that run
    (artifacts / run files). A resumed run rewrites them (the newest invocation, ``ckpt_path`` included), but only
    once its checkpoint has been read: a resume that fails while loading it leaves the run's files as they were
    (the refusal tells the user to reuse them)."""

    versions_filename = "versions.json"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        self._log_dir = run_dir_of(trainer)  # every rank (without RunFolder, log_dir broadcasts)
        # a resume (trainer.ckpt_path is set only later, when Lightning reads the checkpoint): written once the
        # checkpoint has loaded (on_train_start)
        self._pending = bool(self.config.get("ckpt_path")) if hasattr(self.config, "get") else False
        if not self._pending:
            self._write(trainer, pl_module, stage)
        self.already_saved = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if getattr(self, "_pending", False):  # the checkpoint, the optimizer and the loops are restored by now
            self._write(trainer, pl_module, "fit")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if getattr(self, "_pending", False):  # resumed at max_steps (only the export was left): no training started
            self._write(trainer, pl_module, "fit")

    def _write(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._pending = False
        if trainer.is_global_zero:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            record_precision_ran(self.config, trainer)
            self.parser.save(self.config, str(self._log_dir / self.config_filename), skip_none=False, overwrite=True,
                             multifile=self.multifile)
            self.save_config(trainer, pl_module, stage)

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        write_versions(trainer, Path(self._log_dir), [Path(self._log_dir) / self.config_filename])


def write_versions(trainer: L.Trainer, run_dir: Path, files: list[Path]) -> None:
    """``versions.json`` (``package_versions``) in ``run_dir``; it and ``files`` that exist are also attached to the
    run of an MLFlowLogger (artifacts) or WandbLogger (run files). Rank 0."""
    versions = run_dir / SaveRunConfig.versions_filename
    versions.write_text(json.dumps(package_versions(), indent=2) + "\n")
    files = [p for p in (*files, versions) if p.is_file()]
    for logger in trainer.loggers:
        kind = type(logger).__name__
        if kind == "MLFlowLogger":
            for path in files:
                logger.experiment.log_artifact(logger.run_id, str(path))
        elif kind == "WandbLogger":
            for path in files:
                logger.experiment.save(str(path), base_path=str(run_dir), policy="now")


class RunVersions(L.Callback):
    """``versions.json`` in the run folder of a run without a CLI config (``lightalign.Trainer``), as
    ``SaveRunConfig`` writes it beside ``config.yaml``: once training starts, i.e. after a resumed run's checkpoint
    has loaded (a resume that fails while reading it leaves the earlier file), or at the end of a fit that trained
    nothing (resumed at ``max_steps`` to write a missing export)."""

    def __init__(self) -> None:
        self.written = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._run_dir = run_dir_of(trainer)  # every rank (without RunFolder, log_dir broadcasts)
        self.written = stage != "fit"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer)

    def _write(self, trainer: L.Trainer) -> None:
        if self.written:
            return
        self.written = True
        if trainer.is_global_zero:
            self._run_dir.mkdir(parents=True, exist_ok=True)
            write_versions(trainer, self._run_dir, [])
