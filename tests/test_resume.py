"""Exact resume: a run SIGKILLed mid-epoch and resumed from its last checkpoint ends bit-for-bit where an
uninterrupted run ends, with the same logged losses on the steps they share."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
WORKER = Path(__file__).resolve().parent / "resume_worker.py"


def _start(out: Path, method: str, *extra: str) -> subprocess.Popen:
    """The worker in its own session (a kill takes its whole process group), one thread each, so two runs
    share the machine's cores side by side."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(WORKER), "--method", method, "--out", str(out), *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait(proc: subprocess.Popen, expect_kill: bool = False) -> None:
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == (-9 if expect_kill else 0), stderr[-3000:]


def _losses(out: Path, key: str = "train/loss") -> dict[int, float]:
    values = {}
    with open(out / "logs" / "version_0" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row.get(key):
                values[int(row["step"])] = float(row[key])
    return values


@pytest.mark.parametrize("method, max_steps, every, kill_at, devices", [
    ("sft", 14, 4, 10, 1),   # 11 batches/epoch, accumulation 2: 6 steps/epoch; resume at step 8, inside epoch 1
    ("dpo", 14, 4, 10, 1),
    ("grpo", 11, 3, 8, 1),   # a rollout serves 4 micro-steps (2 x 2 iterations); resume at step 6, mid-rollout
    ("sft", 8, 2, 5, 2),     # DDP, 2 processes (gloo): 6 batches/epoch/rank -> 3 steps/epoch; resume at 4, mid-epoch 1
])
def test_killed_and_resumed_equals_uninterrupted(tmp_path, method, max_steps, every, kill_at, devices):
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--max-steps", str(max_steps), "--every", str(every), "--devices", str(devices)]
    # the uninterrupted run and the run that gets killed are independent: run them side by side
    uninterrupted = _start(a, method, *common)
    killed = _start(b, method, *common, "--kill-at", str(kill_at))
    _wait(killed, expect_kill=True)
    _wait(uninterrupted)
    assert not (b / "final.pt").exists()
    resumed_from = (kill_at // every) * every
    assert (b / "ckpt" / "last.ckpt").exists()
    _wait(_start(b, method, *common, "--resume"))
    final_a = torch.load(a / "final.pt", weights_only=True)
    final_b = torch.load(b / "final.pt", weights_only=True)
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        assert torch.equal(final_a[name], final_b[name]), f"{method}: {name} differs after resume"
    la, lb = _losses(a), _losses(b)
    shared = [s for s in la if s >= resumed_from]
    assert shared and all(la[s] == lb[s] for s in shared), {s: (la[s], lb.get(s)) for s in shared}
