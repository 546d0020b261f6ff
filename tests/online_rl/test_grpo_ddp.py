"""The shipped GRPO quickstart under DDP (2 CPU processes, gloo), through the console script as a user runs it: every
callback that works on rank 0 only (the completions table, the curves, the summary) must stay out of collectives,
or the other rank waits forever (CompletionSamples read trainer.log_dir, a broadcast, on rank 0: a hang at the first
step it wrote its table)."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
TIMEOUT = 420  # seconds; the run takes about 30 s of CPU


def test_grpo_quickstart_under_ddp_runs_to_the_end(repo, tiny_dir, data_dir, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    script = Path(sys.executable).with_name("lightalign")
    proc = subprocess.Popen(
        [str(script), "fit", "--config", str(repo / "configs" / "grpo_quickstart.yaml"),
         "--model.model_name_or_path", str(tiny_dir), "--data.path", str(data_dir / "arithmetic_prompts.jsonl"),
         "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.max_steps", "4",
         "--trainer.val_check_interval", "4", "--completions.every_n_steps", "2",
         # collectives of the GRPO knobs: the reward normaliser's and the entropy quantile's all-gathers (token
         # counts differ per rank), the adaptive entropy controller's reduce at each optimizer step
         "--model.normalize_rewards", "true", "--model.top_entropy_quantile", "0.5",
         "--model.use_adaptive_entropy", "true", "--model.entropy_coef", "0.01",
         "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the DDP run hung (killed after {TIMEOUT} s); last output:\n{stdout[-1500:]}\n{stderr[-1500:]}")
    assert proc.returncode == 0, stderr[-3000:]
    run = tmp_path / "runs" / "grpo_quickstart" / "version_0"
    with open(run / "completions.csv", newline="") as f:
        assert {row["step"] for row in csv.DictReader(f)} == {"2", "4"}  # written by rank 0 at steps 2 and 4
    assert (run / "hf_model" / "model.safetensors").is_file() and (run / "curves.png").is_file()
    assert "lightalign run summary" in stdout
    with open(run / "metrics.csv", newline="") as f:
        assert "train/entropy_coef" in next(csv.reader(f))
