"""How a run ends and how it resumes, through the ``lightalign`` console script: ``last.ckpt`` at the final step, a
failed resume leaves the run's files alone, a resume with a larger ``max_steps`` continues the new schedule in the
right epoch, cleans what a killed export left, and sums the whole run; a run that did not train fails.

One 3-step run (an epoch of 3 batches, checkpoints every 2 steps, ``16-mixed`` asked on CPU) is shared; each test
continues a copy of it.
"""

from __future__ import annotations

import csv
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers import console_script

pytestmark = pytest.mark.slow


def run_to_end(repo: Path, *args: str, status: int = 0, real: bool = False) -> str:
    proc = console_script.run(repo, *args, real=real)
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, f"exit {proc.returncode} (expected {status})\n{out[-6000:]}"
    return out


def short_run(save_dir: Path, *extra: str, steps: int = 3) -> list[str]:
    return ["fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", str(steps),
            "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "0",
            "--checkpoint.every_n_train_steps", "2", "--model.lr_scheduler_type", "linear", "--data.batch_size", "4",
            "--trainer.precision", "16-mixed", "--trainer.logger.init_args.save_dir", str(save_dir),
            "--plot.enabled", "false", *extra]


def error_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("lightalign: error:"))


def train_rows(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("train/loss")]


@pytest.fixture(scope="module")
def odd_run_and_output(repo, tmp_path_factory) -> tuple[Path, str]:
    """A finished 3-step run whose checkpoint interval (2) does not divide max_steps; its last step ends epoch 0."""
    save_dir = tmp_path_factory.mktemp("odd")
    # the installed script itself, not a fork of the console server: the server has DeepSpeed imported already (its
    # accelerator warning, which the console script drops, would never be printed, dropped or not)
    out = run_to_end(repo, *short_run(save_dir), real=True)
    return save_dir / "quickstart" / "version_0", out


@pytest.fixture(scope="module")
def odd_run(odd_run_and_output) -> Path:
    return odd_run_and_output[0]


# What the console script keeps out of a run's output (lightalign/quiet.py, RankLogging), by where it came from
NOISE = {
    "transformers config dump at INFO": "Model config Qwen2Config",
    "transformers file names at INFO": "Configuration saved in",
    "Lightning's litlogger tip": "Tip: For seamless cloud",
    "DeepSpeed's accelerator warning": "Setting accelerator to CPU",
    "torch's LeafSpec deprecation": "LeafSpec",
    "datasets' progress bars": "Generating train split",
    "transformers' export progress bar": "Writing model shards",
    "deprecated config aliases read by the layer probe": "is deprecated! Use",
}


def test_a_run_prints_what_a_user_acts_on_and_not_the_libraries_chatter(odd_run_and_output):
    """Mutations (each caught by its line): RankLogging at info for transformers; each filter of quiet.py removed;
    progress bars kept; shrink.py reading torch_dtype/use_return_dict; the lines held until the run starts never released."""
    run, out = odd_run_and_output
    assert {name: text for name, text in NOISE.items() if text in out} == {}
    for kept in ("Seed set to 42", "GPU available: False, used: False", "step 3/3 | train/loss", f"Hugging Face model written to {run / 'hf_model'}", "lightalign run summary",
                 "lightalign adaptations: model qwen2", "Using `precision='bf16-mixed'` instead", "config.yaml records trainer.precision bf16-mixed",
                 "tuned constants: the table (LIGHTALIGN_TUNING=table)"):
        assert kept in out, kept
    assert len(out.splitlines()) < 60, out


def test_console_quiet_is_undone_when_the_command_ends():
    """The filters are installed for the command only: after the block, Lightning's tip logs again and the libraries'
    progress bars are back on. Mutation: no removeFilter / no re-enable -> fails."""
    import logging
    import warnings

    from datasets.utils.tqdm import are_progress_bars_disabled
    from transformers.utils import logging as transformers_logging

    from lightalign.quiet import console_quiet

    tip = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    record = tip.makeRecord(tip.name, logging.INFO, __file__, 1, "💡 Tip: For seamless cloud logging", (), None)
    assert not are_progress_bars_disabled() and transformers_logging.is_progress_bar_enabled()
    with console_quiet(progress_bars=False):
        assert not tip.filter(record)
        assert are_progress_bars_disabled() and not transformers_logging.is_progress_bar_enabled()
        assert any(action == "ignore" and category is FutureWarning and pattern.match("`isinstance(treespec, LeafSpec)` "
                   "is deprecated") for action, pattern, category, _, _ in warnings.filters if pattern is not None)
    assert not any(pattern is not None and pattern.match("`isinstance(treespec, LeafSpec)` is deprecated")
                   for _, pattern, _, _, _ in warnings.filters)
    assert tip.filter(record)
    assert not are_progress_bars_disabled() and transformers_logging.is_progress_bar_enabled()


def copy_run(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "quickstart" / "version_0"
    shutil.copytree(run, target)
    return target


def test_last_checkpoint_is_the_final_step_so_a_finished_run_is_refused(repo, odd_run, tmp_path):
    """Mutation: RunCheckpoint's final save removed -> last.ckpt holds step 2 and the re-run trains step 3, exit 0."""
    assert torch.load(odd_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 3
    run = copy_run(odd_run, tmp_path)
    out = run_to_end(repo, *short_run(tmp_path, "--ckpt_path", "last"), status=1)
    assert error_line(out) == (f"lightalign: error: Checkpoint '{run / 'checkpoints' / 'last.ckpt'}' is at step 3 = "
                               "--trainer.max_steps: that run is finished. Raise --trainer.max_steps above 3 to train "
                               "further.")


def test_config_records_the_precision_that_ran(odd_run):
    """16-mixed on CPU runs as bf16-mixed (Lightning switches it): config.yaml says bf16-mixed.
    Mutation: record_precision_ran not called -> 16-mixed."""
    assert re.search(r"^  precision: bf16-mixed$", (odd_run / "config.yaml").read_text(), re.M)


def test_a_resume_that_fails_loading_the_checkpoint_leaves_config_and_versions(repo, odd_run, tmp_path):
    """The checkpoint passes the pre-checks but its weights do not load. Mutation: SaveRunConfig writes at setup on a
    resume too -> config.yaml has max_steps 5 and ckpt_path last."""
    run = copy_run(odd_run, tmp_path)
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "versions.json")}
    last = run / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    checkpoint["state_dict"].pop("model.model.embed_tokens.weight")
    torch.save(checkpoint, last)
    out = run_to_end(repo, *short_run(tmp_path, "--ckpt_path", "last", steps=5), status=1)
    assert error_line(out).startswith("lightalign: error: The checkpoint holds another model: 1 parameter(s) of this "
                                      "model are missing from it")
    assert {name: (run / name).read_bytes() for name in before} == before


def test_a_resume_with_more_steps_continues_the_new_schedule_in_the_next_epoch(repo, odd_run, tmp_path):
    """Resumed from step 3 (the end of epoch 0) with max_steps 5:
    - steps 4 and 5 run in epoch 1 (mutation: the final last.ckpt saved at on_train_end, after Lightning closed the
      epoch -> step 5 in epoch 2);
    - step 4 runs at the lr of an uninterrupted 5-step schedule, not the 3-step one's 0 (mutation: continue_schedule
      not called -> lr 0 at step 4);
    - the unfinished export folders a killed export left are removed, nothing else (mutation: no cleanup);
    - the summary covers all 5 steps (mutation: RunSummary without state -> tokens of steps 4-5 only, no "resumed");
    - config.yaml is rewritten once the checkpoint loaded (max_steps 5)."""
    from lightalign.modules.training.optimizers import schedule_factor

    run = copy_run(odd_run, tmp_path)
    left = [run / ".hf_model.tmp-abcd1234", run / ".checkpoint-2.tmp-x_y12345"]
    kept = run / ".hf_model.tmp-mine"  # not a name export_hf makes
    for folder in (*left, kept):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    out = run_to_end(repo, *short_run(tmp_path, "--ckpt_path", "last", steps=5))
    rows = train_rows(run)
    assert [(int(r["step"]), int(r["epoch"])) for r in rows] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1)]
    lr = {int(r["step"]): float(r["lr-AdamW/pg1"]) for r in csv.DictReader(open(run / "metrics.csv")) if r.get("lr-AdamW/pg1")}
    assert lr[3] == pytest.approx(3e-3 * schedule_factor(3, 5, 1, "linear"))  # 1.5e-3
    assert "the learning-rate schedule is rebuilt over 5 steps (warmup 1), so step 4 runs at lr 0.0015" in out
    assert not any(p.exists() for p in left) and kept.is_dir()
    assert "Removed 2 unfinished export folder(s)" in out
    summary = out[out.index("lightalign run summary"):]
    assert re.search(r"^  steps +5 \(resumed at step 3\)$", summary, re.M)
    tokens = int(re.search(r"^  tokens +([\d,]+)$", summary, re.M).group(1).replace(",", ""))
    assert tokens == int(float(rows[-1]["train/tokens_seen"]))  # every step's tokens, not only steps 4-5
    assert re.search(r"^  max_steps: 5$", (run / "config.yaml").read_text(), re.M)


def test_a_run_that_skipped_most_steps_fails_without_export(repo, tmp_path):
    """lr 1e4 without clipping: most steps' gradients are non-finite and skipped. Mutation: check_run not called ->
    exit 0 and an export of the diverged weights."""
    out = run_to_end(repo, "fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "7",
                     "--trainer.limit_val_batches", "0", "--model.learning_rate", "1e4", "--trainer.gradient_clip_val",
                     "null", "--data.batch_size", "4", "--trainer.logger.init_args.save_dir", str(tmp_path),
                     "--plot.enabled", "false", status=1)
    line = error_line(out)
    assert re.fullmatch(r"lightalign: error: [4-7] of 7 optimizer steps were skipped for non-finite gradients \(more "
                        r"than half\): the run did not train, so the model is not exported\. .*", line), line
    assert not (tmp_path / "quickstart" / "version_0" / "hf_model").exists()


def test_negative_weight_decay_is_refused_before_the_model_loads(repo, tmp_path):
    """Mutation: the check removed -> training runs with exit 0."""
    out = run_to_end(repo, "fit", "--config", "configs/quickstart.yaml", "--model.weight_decay", "-1",
                     "--trainer.logger.init_args.save_dir", str(tmp_path), status=1)
    assert error_line(out) == "lightalign: error: weight_decay must be >= 0 (0 turns it off), got -1.0."
    assert not (tmp_path / "quickstart").exists()


def test_more_cpu_devices_than_cores_says_what_happens(repo, tmp_path):
    """Lightning's CPU devices are processes: said before any process starts (here max_steps 0 then stops the run,
    so no process is spawned), as one line, followed by the refusal alone. Mutation: the note removed."""
    from lightalign.strategies.launch import usable_cores

    devices = usable_cores() + 1
    out = run_to_end(repo, "fit", "--config", "configs/quickstart.yaml", "--trainer.devices", str(devices),
                     "--trainer.max_steps", "0", "--trainer.logger.init_args.save_dir", str(tmp_path), status=1)
    # the warning as one line, no file path or source line (mutation: quiet.py's one_line_warning not installed ->
    # ".../lightalign/cli.py:177: UserWarning: ..." then "  rank_zero_warn(note)"), and nothing before it
    assert out.splitlines()[0] == (f"UserWarning: --trainer.devices {devices} on CPU starts {devices} training processes "
                                   f"(DDP over gloo), each holding a full copy of the model and training its own batches "
                                   f"(effective batch x{devices}), on {devices - 1} CPU core(s): they share the cores, "
                                   f"so this is slower than --trainer.devices {devices - 1}, not faster."), out[:2000]
    assert out.splitlines()[1] == error_line(out) and "--trainer.max_steps is 0" in error_line(out)
    assert "rank_zero_warn" not in out and "cli.py" not in out


@pytest.mark.parametrize("loss, skipped, steps, message", [
    (float("nan"), 1, 6, "Training ended with a non-finite train/loss (nan) at step 6 (1 of 6 optimizer steps skipped"),
    (float("inf"), 0, 6, "Training ended with a non-finite train/loss (inf) at step 6"),
    (2.0, 4, 6, "4 of 6 optimizer steps were skipped for non-finite gradients (more than half)"),
    (2.0, 3, 6, None),
])
def test_run_end_check(loss, skipped, steps, message):
    """The end-of-run verdict of NonFiniteGuard on a finite/non-finite final loss and skipped-step counts (half is
    allowed, more is not). Mutations: the loss check removed; '>' made '>='."""
    from types import SimpleNamespace

    from lightalign.callbacks.nonfinite import NonFiniteGuard, NonFiniteRunError

    guard = NonFiniteGuard("skip")
    guard.nonfinite_steps = skipped
    trainer = SimpleNamespace(global_step=steps, world_size=1, callback_metrics={"train/loss": torch.tensor(loss)})
    if message is None:
        with pytest.warns(UserWarning, match=f"{skipped} of {steps} optimizer steps were skipped"):
            guard.check_run(trainer, None)
    else:
        with pytest.raises(NonFiniteRunError, match=re.escape(message)):
            guard.check_run(trainer, None)


def test_readme_first_contact(repo, odd_run, tmp_path, monkeypatch):
    """The README says to activate the venv right after `make quickstart`, and its reload snippet loads the newest
    run's export (here version_1; version_0 has none, nor has version_2, a run that stopped early with a checkpoint).
    Mutations: the snippet with runs/quickstart/version_0 -> fails; latest_run(...) / "hf_model" (the newest run with
    a checkpoint) -> fails."""
    readme = (repo / "README.md").read_text()
    setup = readme[readme.index("make quickstart"):readme.index("## Quickstart")]
    assert ". .venv/bin/activate" in setup and ".venv/bin/lightalign" in setup
    snippet = re.search(r"```python\n(from pathlib import Path\n.*?latest_export.*?)```", readme, re.S).group(1)
    shutil.copytree(odd_run, tmp_path / "runs" / "quickstart" / "version_1")
    (tmp_path / "runs" / "quickstart" / "version_0").mkdir()
    stopped = tmp_path / "runs" / "quickstart" / "version_2"  # stopped early: a checkpoint, no export
    shutil.copytree(odd_run / "checkpoints", stopped / "checkpoints")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    prompt = len(scope["tok"]("12+7=")["input_ids"])
    assert prompt < scope["out"].shape[1] <= prompt + 4  # it generated from the loaded model


def test_the_summary_takes_each_metrics_best_in_its_own_direction():
    # the shared keys and a method's summary_stats: a loss and a divergence are best at their minimum, a win rate at
    # its maximum (mutations: a method's summary_stats ignored -> no divergence / win-rate line; every key "max" ->
    # the loss's best is 0.75)
    from types import SimpleNamespace

    from lightalign.callbacks.summary import RunSummary

    summary = RunSummary()
    module = SimpleNamespace(summary_stats={"divergence": "min", "win_rate": "max"})
    for step, (loss, divergence, win_rate) in enumerate([(0.75, 0.75, 0.25), (0.125, 0.125, 0.625), (0.5, 0.5, 0.375)]):
        metrics = {"val/loss": torch.tensor(loss), "val/divergence": torch.tensor(divergence),
                   "val/win_rate": torch.tensor(win_rate), "val/other": torch.tensor(1.0)}
        summary._record(SimpleNamespace(callback_metrics=metrics, global_step=step), module, ("val",))
    assert summary._best == {"val/loss": (1, 0.125), "val/divergence": (1, 0.125), "val/win_rate": (1, 0.625)}
    assert summary._final == {"val/loss": (2, 0.5), "val/divergence": (2, 0.5), "val/win_rate": (2, 0.375)}
