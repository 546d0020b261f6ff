"""Console runs of the quickstart config and what they leave in their run folders, for the tests of run folders,
resume and ownership (tests/training/test_runs.py, test_run_lock.py)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

from helpers import console_script


def quickstart(save_dir: Path, *extra: str, steps: int = 4) -> list[str]:
    """``lightalign`` arguments of a short quickstart run under ``save_dir`` (validation and a checkpoint every 2
    steps, no curves)."""
    return ["fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", str(steps),
            "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1", "--checkpoint.every_n_train_steps",
            "2", "--trainer.logger.init_args.save_dir", str(save_dir), "--plot.enabled", "false", *extra]


def run_to_end(repo: Path, *args: str, status: int = 0, extra_env: dict | None = None) -> str:
    """Run the console script to its end (tests/helpers/console_script.py), check its exit status, return its output."""
    proc = console_script.run(repo, *args, env=console_script.standard_env(**(extra_env or {})))
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, f"exit {proc.returncode} (expected {status})\n{out[-6000:]}"
    return out


def metric_steps(run_dir: Path, key: str = "train/loss") -> list[int]:
    """The steps of ``run_dir/metrics.csv`` that logged ``key``, in file order."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get(key)]


def finished_quickstart(repo: Path, save_dir: Path) -> Path:
    """A finished 4-step quickstart run (checkpoint at step 4, export written): ``save_dir/quickstart/version_0``."""
    run_to_end(repo, *quickstart(save_dir))
    return save_dir / "quickstart" / "version_0"


def copy_run(run: Path, tmp_path: Path) -> Path:
    """A copy of a run folder under tmp_path/quickstart/version_0 (tests that continue it leave the original)."""
    target = tmp_path / "quickstart" / "version_0"
    shutil.copytree(run, target)
    return target
