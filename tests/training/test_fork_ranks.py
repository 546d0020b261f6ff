"""tests/helpers/fork_ranks.py, which the multi-process test workers start their ranks with: each forked rank gets
its own LOCAL_RANK and the launch variables, and a rank that fails stops the others (as Lightning's launcher does)
instead of leaving them waiting in a collective. Plain Python workers (no torch): each check costs a fork."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
# a worker of 2 ranks: each writes what it got to DIR/rank<r>.json; rank `fails` then waits for the other's file
# (so both reported) and raises; the others wait (up to 120 s, as in a collective)
WORKER = f"""
import json, os, sys, time
sys.path.insert(0, {str(TESTS)!r})
from helpers.fork_ranks import fork_ranks
rank = fork_ranks(2)
fails, folder = int(sys.argv[1]), sys.argv[2]
variables = {{k: os.environ.get(k) for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}}
with open(os.path.join(folder, f"rank{{rank}}.tmp"), "w") as f:
    json.dump(dict(variables, pid=os.getpid()), f)
os.replace(os.path.join(folder, f"rank{{rank}}.tmp"), os.path.join(folder, f"rank{{rank}}.json"))
if rank == fails:
    while len([n for n in os.listdir(folder) if n.endswith(".json")]) < 2:
        time.sleep(0.01)
    raise RuntimeError(f"rank {{rank}} failed")
time.sleep(0.5 if fails < 0 else 120)
"""


def _run(fails: int, folder: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", WORKER, str(fails), str(folder)], env=env, capture_output=True,
                          text=True, timeout=100)  # the safety net: a rank left waiting would take 120 s
    return proc, [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


def test_forked_ranks_get_their_own_rank_and_the_launch_variables(tmp_path):
    proc, ranks = _run(-1, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(r["LOCAL_RANK"] for r in ranks) == ["0", "1"]
    assert {r["WORLD_SIZE"] for r in ranks} == {"2"} and {r["NODE_RANK"] for r in ranks} == {"0"}
    assert len({r["MASTER_PORT"] for r in ranks}) == 1 and ranks[0]["MASTER_ADDR"] == "127.0.0.1"


@pytest.mark.parametrize("fails", [0, 1])
def test_a_failing_rank_stops_the_others(fails, tmp_path):
    """Rank 1 raising makes rank 0 exit with status 1 (first line of its own message: which rank stopped it); rank 0
    raising kills rank 1."""
    proc, ranks = _run(fails, tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert f"RuntimeError: rank {fails} failed" in proc.stderr
    if fails == 1:
        assert "exited with status 1: stopping rank 0" in proc.stderr
    survivor = next(r["pid"] for r in ranks if r["LOCAL_RANK"] != str(fails))
    with pytest.raises(ProcessLookupError):  # rank 0 waited for it (reaped) or killed it
        os.kill(survivor, 0)
