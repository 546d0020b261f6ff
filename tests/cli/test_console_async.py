"""The ``lightalign`` console script with asynchronous rollouts: the GRPO demo config trains one rollout ahead and
logs the sampler's staleness and the log-prob mismatch; a staleness the schedule cannot honour is one line, before
training; a resume with ``--ckpt_path last`` continues on the rollout the checkpoint kept."""

from __future__ import annotations

import csv

import pytest
import torch

from helpers import console_script

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
lightalign = console_script.expect


def async_run(save_dir, steps: int, *extra: str) -> list[str]:
    return ["fit", "--config", "configs/grpo_quickstart.yaml", "--trainer.max_steps", str(steps),
            "--trainer.limit_val_batches", "0", "--trainer.logger.init_args.save_dir", str(save_dir),
            "--checkpoint.dirpath", str(save_dir / "ckpt"), "--checkpoint.every_n_train_steps", "2",
            "--model.init_args.generation_batch_size", "16", "--model.init_args.max_staleness", "1", *extra]


def rows(save_dir, version: int) -> list[dict]:
    with open(save_dir / "grpo_quickstart" / f"version_{version}" / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("train/sampling/staleness")]


def test_async_grpo_trains_one_rollout_ahead_and_resumes_on_the_kept_rollout(repo, tmp_path):
    out = lightalign(repo, *async_run(tmp_path, 3))
    assert "step 3/3" in out and "Traceback" not in out
    assert "asynchronous rollouts: 1 rollout(s) ahead, at most 1 optimizer step(s) old (max_staleness 1)" in out
    logged = rows(tmp_path, 0)
    assert [float(r["train/sampling/staleness"]) for r in logged] == [0.0, 1.0, 1.0]
    assert all(float(r["train/sampling/importance_sampling_ratio/mean"]) > 0 for r in logged)
    assert all(r["train/sampling/sampling_logp_difference/max"] != "" for r in logged)
    kept = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["lightalign_rollout"]["ranks"][0]
    # last.ckpt is the final step's (3, not a multiple of every_n_train_steps): it holds rollout 3, sampled on step
    # 2's weights
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 3
    assert list(kept["ahead_rollouts"]) == [3]
    out = lightalign(repo, *async_run(tmp_path, 4, "--ckpt_path", "last"))
    assert "Traceback" not in out
    resumed = {int(r["step"]): float(r["train/sampling/staleness"]) for r in rows(tmp_path, 1)}
    assert resumed == {0: 0.0, 1: 1.0, 2: 1.0, 3: 1.0}  # the run's log continued: step 3 trained on the kept rollout


def test_a_staleness_the_schedule_cannot_honour_is_one_line_before_training(repo, tmp_path):
    out = lightalign(repo, *async_run(tmp_path, 2, "--model.init_args.steps_per_generation", "2",
                                      "--model.init_args.generation_batch_size", "32"), status=1)
    assert "lightalign: error: GRPOModule: max_staleness=1 is less than the 2 optimizer steps one rollout trains" in out
    assert "Traceback" not in out and not list(tmp_path.rglob("metrics.csv"))
