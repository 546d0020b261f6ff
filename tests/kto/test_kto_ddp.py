"""KTO under DDP (2 CPU processes, gloo): the KL term is the mean of the ranks' estimates (then clamped at 0), the
same on every rank, and the precomputed reference log-probs (each rank computes its share) equal a 1-process run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import console_script

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
WORKER = Path(__file__).resolve().parents[1] / "workers" / "kto_worker.py"


def run(devices: int, out: Path) -> list[dict]:
    proc = console_script.run_python(WORKER, "--devices", str(devices), "--out", str(out),
                                     env=console_script.standard_env(OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]


def test_kl_is_averaged_over_ranks_and_precompute_is_sharded(tmp_path):
    (single,) = run(1, tmp_path / "one")
    ranks = run(2, tmp_path / "two")
    locals_ = [r["local"] for r in ranks]
    assert locals_[0] != pytest.approx(locals_[1])  # each rank estimated from its own micro-batch
    mean = sum(locals_) / 2
    for r in ranks:
        assert r["mean"] == pytest.approx(mean, abs=1e-6)
        assert r["kl"] == pytest.approx(max(mean, 0.0), abs=1e-6)
        assert r["logps"] == pytest.approx(single["logps"], abs=1e-5)
        assert r["kl_logps"] == pytest.approx(single["kl_logps"], abs=1e-5)
