"""configs/reward_tiny.yaml through the ``lightalign`` console script: exit status, the sequence-classification
export, val accuracy in metrics.csv, and ``--ckpt_path last`` continuing the run in its folder."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from helpers import console_script

pytestmark = pytest.mark.slow


def lightalign(repo: Path, *args: str, status: int = 0) -> str:
    proc = console_script.run(repo, *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, f"exit {proc.returncode} (expected {status})\n{out[-6000:]}"
    return out


def metric_rows(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_reward_tiny_config_trains_exports_and_resumes(repo, tmp_path):
    args = ["fit", "--config", "configs/reward_tiny.yaml", "--trainer.logger.init_args.save_dir", str(tmp_path),
            "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2", "--plot.enabled", "false",
            "--checkpoint.every_n_train_steps", "2"]
    out = lightalign(repo, *args, "--trainer.max_steps", "4")
    run = tmp_path / "reward_tiny" / "version_0"
    export = run / "hf_model"
    config = json.loads((export / "config.json").read_text())
    assert len(config["id2label"]) == 1 and config["architectures"] == ["Qwen2ForSequenceClassification"], config
    assert config["pad_token_id"] == 0 and (export / "tokenizer.json").is_file()
    assert "prompt_sharing switched off" not in out  # the config asks for padded rows itself
    rows = metric_rows(run)
    accuracy = [float(r["val/accuracy"]) for r in rows if r.get("val/accuracy")]
    assert len(accuracy) == 2 and all(0.0 <= a <= 1.0 for a in accuracy)
    assert [int(r["step"]) for r in rows if r.get("train/accuracy")] == [0, 1, 2, 3]

    out = lightalign(repo, *args, "--trainer.max_steps", "6", "--ckpt_path", "last")
    assert "Continuing run" in out and not (tmp_path / "reward_tiny" / "version_1").exists()
    assert [int(r["step"]) for r in metric_rows(run) if r.get("train/loss")] == list(range(6))
