"""A process the run needs dies under it (issue 48, "One line, not a traceback"): the console script says in one
``lightalign: error:`` line which process died (its pid, the signal or exit code) and that ``--ckpt_path last``
resumes, exit 1, no traceback (``lightalign.process_death``).

The process is killed from inside the run at a known optimizer step (``helpers.kill_at_step``), so nothing depends
on timing. Each run is a console-script process with tests/ on PYTHONPATH (the kill callback is named by a second
``--config``), forked from the tests' console server (``console_script.run`` with ``tests_env()``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import console_script
from helpers.kill_at_step import kill_config

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
RESUME = "The checkpoints written so far are intact: the same command with --ckpt_path last continues the run."


def lightalign(repo: Path, *args: str, status: int) -> str:
    """The console script with tests/ importable (the kill callbacks); its output, the exit status checked."""
    proc = console_script.run(repo, *args, env=console_script.tests_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, f"exit {proc.returncode} (expected {status})\n{out[-6000:]}"
    return out


error_line = console_script.error_line


def async_run(save_dir: Path, *extra: str) -> list[str]:
    return ["fit", "--config", "configs/grpo_quickstart.yaml", "--trainer.max_steps", "4", "--trainer.limit_val_batches",
            "0", "--trainer.logger.init_args.save_dir", str(save_dir), "--checkpoint.every_n_train_steps", "2",
            "--model.init_args.generation_batch_size", "16", "--model.init_args.max_staleness", "1", *extra]


def test_a_killed_sampling_process_is_one_line_naming_it_and_the_resume(repo, tmp_path):
    """The trial's case: the sampling process of an asynchronous run SIGKILLed on its own (here after step 3, the
    step-2 checkpoint written): ~115 lines ending in ``SamplerProcessError: ... (code -9)`` before. The resume the
    line advises then finishes the run."""
    kill = kill_config(tmp_path / "kill", "KillSampler", step=3)
    out = lightalign(repo, *async_run(tmp_path, "--config", str(kill)), status=1)
    line = error_line(out)
    assert line.startswith("lightalign: error: The sampling process of the asynchronous rollouts (pid "), line
    assert ") was killed by SIGKILL (a kill from outside, or the out-of-memory killer) while the run waited for its " \
           "rollout " in line and line.endswith(RESUME), line
    assert "Traceback" not in out, out[-4000:]
    out = lightalign(repo, *async_run(tmp_path, "--ckpt_path", "last"), status=0)
    assert "step 4/4" in out and "Traceback" not in out, out[-4000:]


def ddp_run(save_dir: Path, *extra: str) -> list[str]:
    return ["fit", "--config", "configs/quickstart.yaml", "--trainer.devices", "2", "--trainer.strategy", "ddp",
            "--trainer.accelerator", "cpu", "--trainer.max_steps", "4", "--trainer.limit_val_batches", "0",
            "--trainer.logger.init_args.save_dir", str(save_dir), "--checkpoint.every_n_train_steps", "2",
            "--plot.enabled", "false", *extra]


def test_a_killed_ddp_rank_is_one_line_naming_it_and_the_resume(repo, tmp_path):
    """The trial's case: rank 1 of a 2-process CPU DDP run SIGKILLed on its own (after step 3; the step-2 checkpoint
    written): rank 0 ended on gloo's ``Connection reset by peer`` traceback, naming no rank. The resume the line
    advises then finishes the run (a DDP run that ends well: the watch leaves it alone)."""
    kill = kill_config(tmp_path / "kill", "KillRank", step=3, rank=1)
    out = lightalign(repo, *ddp_run(tmp_path, "--config", str(kill)), status=1)
    line = error_line(out)
    assert line.startswith("lightalign: error: DDP rank 1 (pid "), line
    assert ") was killed by SIGKILL (a kill from outside, or the out-of-memory killer) while the run was training " \
           "(step 3 done)." in line and line.endswith(RESUME), line
    assert "Traceback" not in out and "Connection reset" not in out, out[-4000:]
    out = lightalign(repo, *ddp_run(tmp_path, "--ckpt_path", "last"), status=0)
    assert "step 4/4" in out and "Traceback" not in out, out[-4000:]


def test_an_error_with_every_rank_alive_is_not_taken_for_a_death(repo, tmp_path):
    """Rank 0's own error (every rank alive) stays what it is: no rank is named, nothing is said about resuming."""
    fail = kill_config(tmp_path / "fail", "FailOnRank", step=2, rank=0)
    out = lightalign(repo, *ddp_run(tmp_path, "--config", str(fail)), status=1)
    assert "RuntimeError: FailOnRank: rank 0 fails after step 2" in out, out[-4000:]
    assert "lightalign: error: DDP rank" not in out and "continues the run." not in out, out[-4000:]
