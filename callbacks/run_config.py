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


class SaveRunConfig(SaveConfigCallback):
    """``config.yaml`` (what ``--print_config`` prints) and ``versions.json`` in the run folder, whatever the
    logger (``lightalign.runs``); with an MLFlowLogger or WandbLogger both files are also attached to that run
    (artifacts / run files). A resumed run rewrites them (the newest invocation, ``ckpt_path`` included)."""

    versions_filename = "versions.json"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        self._log_dir = run_dir_of(trainer)  # every rank (without RunFolder, log_dir broadcasts)
        if trainer.is_global_zero:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            self.parser.save(self.config, str(self._log_dir / self.config_filename), skip_none=False, overwrite=True,
                             multifile=self.multifile)
            self.save_config(trainer, pl_module, stage)
        self.already_saved = True

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        log_dir = Path(self._log_dir)
        versions = log_dir / self.versions_filename
        versions.write_text(json.dumps(package_versions(), indent=2) + "\n")
        files = [p for p in (log_dir / self.config_filename, versions) if p.is_file()]
        for logger in trainer.loggers:
            kind = type(logger).__name__
            if kind == "MLFlowLogger":
                for path in files:
                    logger.experiment.log_artifact(logger.run_id, str(path))
            elif kind == "WandbLogger":
                for path in files:
                    logger.experiment.save(str(path), base_path=str(log_dir), policy="now")
