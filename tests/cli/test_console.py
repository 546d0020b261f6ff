"""The ``lightalign`` console script as a new user meets it: exit statuses, help pages, one-line errors, the
progress lines, ``enable_checkpointing: false``, ``max_steps: 0``, the export's file permissions.

Every test runs the venv's console script in a process of its own and checks its exit status and output
(tests/helpers/console_script.py: forked from a server that imported torch and Lightning once, or the script itself).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import console_script

pytestmark = pytest.mark.slow


lightalign = console_script.expect


def short_run(save_dir: Path, *extra: str) -> list[str]:
    return ["fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "2", "--trainer.limit_val_batches",
            "0", "--plot.enabled", "false", "--trainer.logger.init_args.save_dir", str(save_dir), *extra]


def test_plot_exit_status(repo, tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run" / "version_0"
    run.mkdir(parents=True)
    with open(run / "metrics.csv", "w", newline="") as f:
        csv.writer(f).writerows([["step", "train/loss"], [0, 2.0], [1, 1.5]])
    out = lightalign(repo, "plot", str(run))
    assert (run / "curves.png").is_file() and f"Learning curves written to {run / 'curves.png'}" in out
    assert "Figure(" not in out
    out = lightalign(repo, "plot", str(tmp_path / "nowhere"), status=1)
    assert "lightalign: error: Run folder" in out and "does not exist" in out and "Traceback" not in out


def test_console_server_runs_what_the_script_runs(repo, tmp_path):
    """The fork-server way of running the console script (what most console tests use) gives the exit status,
    standard output and standard error of the installed script itself."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2"\n')
    cases = [("--help",), ("plot", str(tmp_path / "nowhere")),
             short_run(tmp_path, "--data.path", str(bad), "--data.val_path", "null")]
    # the installed script's runs side by side (each imports torch and Lightning: most of this test's time), while
    # the console server forks the same calls one after the other
    scripts = [subprocess.Popen([str(console_script.LIGHTALIGN), *args], cwd=repo, env=console_script.standard_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in cases]
    for args, script in zip(cases, scripts):
        calls = console_script._SERVER.calls if console_script._SERVER else 0
        forked = console_script.run(repo, *args)
        assert console_script._SERVER is not None and console_script._SERVER.calls == calls + 1  # it was forked
        stdout, stderr = script.communicate(timeout=900)
        assert (forked.returncode, forked.stdout, forked.stderr) == (script.returncode, stdout, stderr)
    assert script.returncode == 1 and "line 2" in stderr


def test_help_pages(repo):
    top = lightalign(repo, "--help")
    assert "lightalign plot RUN_DIR" in top and "--ckpt_path last" in top
    module = lightalign(repo, "fit", "--model.help", "lightalign.SFTModule")
    assert "--model.model_name_or_path" in module and "--model.learning_rate" in module
    assert "--model.model " not in module and "--model.model.help" not in module  # the Python-only nn.Module
    assert "torch.nn" not in module


def test_errors_are_one_message_and_the_traceback_is_opt_in(repo, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(8)))
    args = short_run(tmp_path, "--data.path", str(bad), "--data.val_path", "null")
    out = lightalign(repo, *args, status=1)
    error = [line for line in out.splitlines() if line.startswith("lightalign: error:")]
    assert len(error) == 1 and "format" in error[0] and "Traceback" not in out, out[-3000:]
    assert "LIGHTALIGN_DEBUG=1" in out  # how to see more
    # the error is the first line: Lightning's "Seed set to 42" and "GPU available: ..." are held back until the data
    # was read (mutation: the lines not held -> they come first), and the refused run leaves no empty version_0
    # behind (mutation: discard_empty_run_folder not called -> quickstart/version_0 stays)
    assert out.splitlines()[0] == error[0], out[:2000]
    assert not (tmp_path / "quickstart").exists()
    assert "Traceback" in lightalign(repo, *args, "--debug", status=1)
    assert "Traceback" in lightalign(repo, *args, status=1, LIGHTALIGN_DEBUG="1")


def test_a_reward_model_that_is_missing_or_no_classifier_fails_before_the_policy_loads(repo, tmp_path):
    """A mistyped hub name (offline) and a causal-LM folder as reward model: one error line naming the reward model,
    at construction (no model summary, no rollout row blamed), exit status 1."""
    grpo = ["fit", "--config", "configs/grpo_quickstart.yaml", "--trainer.max_steps", "1",
            "--trainer.logger.init_args.save_dir", str(tmp_path), "--model.reward_funcs"]
    for reward, message in [("my_org/no-such-reward-model", "Reward model: 'my_org/no-such-reward-model' is not a "
                                                            "local folder, and HF_HUB_OFFLINE is set"),
                            ("assets/models/tiny", "Reward model 'assets/models/tiny' has no score head (its "
                                                   "config.json names ['Qwen2ForCausalLM'])")]:
        out = lightalign(repo, *grpo, f"[{reward}]", status=1)
        error = [line for line in out.splitlines() if line.startswith("lightalign: error:")]
        assert len(error) == 1 and message in error[0] and "Traceback" not in out, out[-3000:]
        assert "Trainable params" not in out and "at index" not in out, out[-3000:]
    assert not list(tmp_path.rglob("metrics.csv"))


def test_max_steps_zero_says_there_is_nothing_to_train(repo, tmp_path):
    out = lightalign(repo, *short_run(tmp_path), "--trainer.max_steps", "0", status=1)
    assert "--trainer.max_steps is 0 (max_steps=0): there is nothing to train" in out and "Traceback" not in out
    assert not list(tmp_path.rglob("metrics.csv"))


def test_logger_false_trains_checkpoints_and_exports(repo, tmp_path):
    """trainer.logger: false (a common way to silence a run) trains, checkpoints and exports under default_root_dir
    (Lightning's LearningRateMonitor refuses a Trainer without a logger: it steps aside)."""
    out = lightalign(repo, "fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "2",
                     "--trainer.limit_val_batches", "0", "--plot.enabled", "false", "--trainer.logger", "false",
                     "--trainer.default_root_dir", str(tmp_path))
    assert "step 2/2" in out and "LearningRateMonitor" not in out
    assert list(tmp_path.rglob("last.ckpt")) and list(tmp_path.rglob("hf_model/model.safetensors"))


def test_checkpointing_off_progress_lr_once_and_export_permissions(repo, tmp_path):
    """enable_checkpointing false is honoured (no ModelCheckpoint, no checkpoints/); the progress lines show the
    learning rate once, as `lr`; the export has the umask's permissions (not the temp folder's 0700/0600)."""
    out = lightalign(repo, *short_run(tmp_path, "--trainer.enable_checkpointing", "false"))
    run = tmp_path / "quickstart" / "version_0"
    assert not (run / "checkpoints").exists() and (run / "hf_model" / "model.safetensors").is_file()
    line = next(ln for ln in out.splitlines() if ln.startswith("step 2/2"))
    assert " | lr " in line and "train/lr" not in line, line
    umask = os.umask(0)
    os.umask(umask)
    export = run / "hf_model"
    assert (export.stat().st_mode & 0o777) == 0o777 & ~umask
    assert {(p.stat().st_mode & 0o777) for p in export.iterdir()} == {0o666 & ~umask}
