"""Exact resume of what a run logs: a run SIGKILLed and resumed writes the uninterrupted run's ``metrics.csv`` and
``completions.csv``, row for row, where the resume used to lose rows:

* GRPO with ``steps_per_generation 2`` and ``num_iterations 2`` (a rollout serves 4 optimizer steps) killed after
  a checkpoint inside a rollout: the rollout statistics (``train/reward/*``, ``train/completions/*``), which
  Lightning writes again on every step of the rollout (``modules/training/carried_metrics.py``), and the sample
  table of the rollout (``completions.csv``, ``modules/rollout/state.py``) on its remaining steps;
* killed after a step's batch end and before that step's validation: ``val/*`` of that step
  (``callbacks/run_checkpoint.py``: the checkpoint is written after the validation).

The worker (tests/workers/resume_worker.py, ``--continue-log``) logs every launch into one ``metrics.csv``, continued
on resume as a run folder is (``runs.continue_metrics_csv``), flushed at every row. Kills come at steps chosen by
construction (``--kill-at``: a step's batch end; ``--kill-at-validation``: as a step's validation starts)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from helpers import console_script

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
WORKER = Path(__file__).resolve().parents[1] / "workers" / "resume_worker.py"
WALL_CLOCK = ("train/tokens_per_sec", "train/samples_per_sec", "train/tflops_per_sec")  # none logged here yet


def _run(out: Path, *args: str, killed: bool = False) -> None:
    """The GRPO worker to its end (or its kill), forked from the console server, one thread each."""
    proc = console_script.run_python(WORKER, "--method", "grpo", "--out", str(out), "--continue-log", *args,
                                     env=console_script.standard_env(OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == (-9 if killed else 0), proc.stderr[-3000:]


def _table(out: Path, name: str) -> tuple[list[str], list[dict[str, str]]]:
    with open(out / "logs" / "version_0" / name, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), [{k: v for k, v in row.items() if k not in WALL_CLOCK} for row in reader]


def _assert_same_logs(a: Path, b: Path) -> dict[str, list[dict[str, str]]]:
    """metrics.csv and completions.csv of the two runs, equal row for row (wall-clock columns aside)."""
    tables = {}
    for name in ("metrics.csv", "completions.csv"):
        (columns_a, rows_a), (columns_b, rows_b) = _table(a, name), _table(b, name)
        assert sorted(columns_a) == sorted(columns_b), (name, set(columns_a) ^ set(columns_b))
        assert len(rows_a) == len(rows_b), (name, [r["step"] for r in rows_a], [r["step"] for r in rows_b])
        for i, (x, y) in enumerate(zip(rows_a, rows_b)):
            assert x == y, (name, i, {k: (x.get(k), y.get(k)) for k in x if x.get(k) != y.get(k)})
        tables[name] = rows_a
    return tables


def _steps(rows: list[dict[str, str]], key: str) -> list[int]:
    return [int(r["step"]) for r in rows if r.get(key)]


def _same_weights(a: Path, b: Path) -> None:
    final_a, final_b = (torch.load(p / "final.pt", weights_only=True)["model"] for p in (a, b))
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


# (devices, max_steps, prompts per rank, kill): a rollout serves 4 steps (0-3, 4-7, ...); checkpoints every 2 steps;
# killed at 3 -> resumed from the step-2 checkpoint, inside the first rollout (steps 2 and 3 are that rollout's)
CASES = [(1, 12, 4, 3), (2, 6, 2, 3)]


@pytest.mark.parametrize("devices, max_steps, prompts, kill", CASES, ids=[f"{c[0]}proc" for c in CASES])
def test_grpo_resumed_inside_a_rollout_logs_what_the_uninterrupted_run_logs(tmp_path, devices, max_steps, prompts,
                                                                            kill):
    """Mutations: the carried metrics not put back (``CarriedStepMetrics.on_train_batch_end`` returning at once) ->
    train/reward/* and train/completions/* empty at steps 2-3, fails; ``last_samples`` not restored
    (``load_rollout_state``) -> completions.csv has no rows for steps 3-4, fails."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--max-steps", str(max_steps), "--every", "2", "--devices", str(devices),
              "--prompts-per-rank", str(prompts)]
    _run(a, *common)
    _run(b, *common, "--kill-at", str(kill), killed=True)
    assert torch.load(b / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 2
    _run(b, *common, "--resume")
    _same_weights(a, b)
    tables = _assert_same_logs(a, b)
    metrics = tables["metrics.csv"]
    # what the comparison is about: the rollout statistics on every step, the sample table on every step
    assert _steps(metrics, "train/reward/mean") == _steps(metrics, "train/completions/mean_length") == \
        list(range(max_steps))
    assert sorted({int(r["step"]) for r in tables["completions.csv"]}) == list(range(1, max_steps + 1))


def test_kill_between_a_step_and_its_validation_validates_that_step_after_the_resume(tmp_path):
    """Validation after every 4th step, checkpoints every 2; killed as the validation after step 4 starts (after
    that step's batch end, where the checkpoint used to be written): the step-4 checkpoint is written only after
    its validation, so the run resumes from step 2 and validates step 4; then a run resumed from the step-4
    checkpoint (written after the validation) goes on with step 5. Mutations: ``validation_follows`` always False
    (the checkpoint at the batch end) -> last.ckpt at step 4, and resumed from it without its validation the val/*
    row of step 4 (step index 3) is missing, fails; the datamodule's ``state_dict`` empty outside
    ``trainer.training`` (before) -> the post-validation checkpoint resumes at the epoch's start, other weights,
    fails."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--max-steps", "10", "--every", "2", "--prompts-per-rank", "4", "--val-every", "4"]
    _run(a, *common)
    _run(b, *common, "--kill-at-validation", "4", killed=True)
    assert torch.load(b / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in (b / "ckpt").glob("*step=*")) == ["epoch=0-step=2.ckpt"]
    _run(b, *common, "--resume")
    _same_weights(a, b)
    metrics = _assert_same_logs(a, b)["metrics.csv"]
    assert _steps(metrics, "val/reward/mean") == [3, 7]  # after steps 4 and 8 (logged on the step index 3, 7)
    # the checkpoint after a validation resumes with the next step, without validating again
    c = tmp_path / "c"
    _run(c, *common, "--kill-at", "5", killed=True)
    assert torch.load(c / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 4
    _run(c, *common, "--resume")
    _same_weights(a, c)
    _assert_same_logs(a, c)
