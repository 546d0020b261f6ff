"""``SaveRunConfig``: the resolved config and the package versions beside every run, so it can be reproduced."""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata
from pathlib import Path

import lightning as L
from lightning.pytorch.cli import SaveConfigCallback

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
    """LightningCLI's config saving (``config.yaml`` in the run's log_dir) plus ``versions.json`` beside it; with
    an MLFlowLogger or WandbLogger both files are also attached to that run (artifacts / run files)."""

    versions_filename = "versions.json"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.already_saved:
            self._log_dir = trainer.log_dir  # every rank: it broadcasts; save_config below runs on rank 0 only
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        log_dir = Path(self._log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
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
