"""One run = one folder, and ``--ckpt_path last``: through the ``lightalign`` console script, as users run it.

Each test starts the console script in a subprocess and checks its exit status and what it printed. Runs are the
shipped quickstart/DPO (and, for a killed sampling run, distillation and online DPO) configs cut to a few steps.
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import console_script
from helpers.run_folders import copy_run, finished_quickstart, metric_steps, quickstart, run_to_end

pytestmark = pytest.mark.slow
LIGHTALIGN = Path(sys.executable).with_name("lightalign")  # the venv's console script


def env(**extra: str) -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)


def lightalign(repo: Path, *args: str, extra_env: dict | None = None) -> subprocess.Popen:
    """Start the console script in its own process group (a kill takes all of it); output goes to pipes."""
    return subprocess.Popen([str(LIGHTALIGN), *args], cwd=repo, env=env(**(extra_env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)




def finish(proc: subprocess.Popen, status: int = 0) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == status, f"exit {proc.returncode} (expected {status})\n{out[-6000:]}"
    return out






@pytest.fixture(scope="module")
def finished_run(repo, tmp_path_factory) -> Path:
    return finished_quickstart(repo, tmp_path_factory.mktemp("finished"))




def test_killed_run_continues_in_its_folder_without_lost_or_repeated_rows(repo, tmp_path):
    """SIGKILL after the step-10 checkpoint once rows past it are on disk; the same command resumes version_0."""
    args = ["fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "24", "--trainer.val_check_interval",
            "10", "--trainer.limit_val_batches", "1", "--checkpoint.every_n_train_steps", "10",
            "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.logger.init_args.flush_logs_every_n_steps",
            "1", "--plot.enabled", "false", "--ckpt_path", "last"]
    run = tmp_path / "quickstart" / "version_0"
    with console_script.start(repo, *args) as first:  # forked from the console server, in a session of its own
        deadline = time.monotonic() + 600
        while not ((run / "metrics.csv").is_file() and any(s >= 13 for s in metric_steps(run))):
            assert first.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGKILL)
        proc = first.wait()
    out = proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}\n{out[-6000:]}"
    assert "no earlier run of this config has a checkpoint" in out and "starting a new run" in out
    step = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"]
    logged = metric_steps(run)
    assert step == 10 and max(logged) >= step + 3  # the killed run logged steps its checkpoint does not hold

    out = run_to_end(repo, *args)
    assert f"Continuing run {run} from step 10" in out
    # resumed mid-epoch at the exact batch (the rows below): Lightning's "your dataloader is not resumable" is false
    # here and not printed (mutation: exact_resume_quiet not applied -> printed)
    assert "not resumable" not in out
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]  # no second run folder
    assert metric_steps(run) == list(range(24))  # every step once: nothing lost, nothing repeated
    assert metric_steps(run, "val/loss") == [9, 19]
    assert (run / "hf_model" / "model.safetensors").is_file() and (run / "config.yaml").is_file()


def test_resume_refuses_another_method_model_layout_or_a_reached_max_steps(repo, finished_run, tmp_path):
    ckpt = str(finished_run / "checkpoints" / "last.ckpt")
    other_model = tmp_path / "other-tiny"
    shutil.copytree(repo / "assets" / "models" / "tiny", other_model)
    other_model.joinpath("config.json").write_text(
        other_model.joinpath("config.json").read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 1'))
    save_dir = finished_run.parent.parent
    cases = {
        "method": (["fit", "--config", "configs/dpo_tiny.yaml", "--trainer.logger.init_args.save_dir", str(tmp_path),
                    "--ckpt_path", ckpt], ["written with method 'SFTModule'", "'DPOModule'"]),
        "model": (quickstart(save_dir, "--model.model_name_or_path", str(other_model), "--ckpt_path", ckpt, steps=8),
                  ["written with model 'assets/models/tiny'", str(other_model)]),
        "batch": (quickstart(save_dir, "--data.batch_size", "16", "--ckpt_path", "last", steps=8),
                  ["--data.batch_size = 32, the config has 16", "Resume with 32"]),
        "below": (quickstart(save_dir, "--ckpt_path", "last", steps=3),
                  ["is at step 4, past --trainer.max_steps 3", "Raise --trainer.max_steps above 4"]),
        "finished": (quickstart(save_dir, "--ckpt_path", "last", steps=4),
                     ["is at step 4 = --trainer.max_steps: that run is finished"]),
    }
    before = (finished_run / "metrics.csv").read_text()
    for name, (args, texts) in cases.items():  # each forked from the console server: a refusal costs no import
        out = run_to_end(repo, *args, status=1)
        for text in texts:
            assert text in out, f"{name}: {text!r} not in\n{out[-3000:]}"
        assert "Traceback" not in out, name
    assert (finished_run / "metrics.csv").read_text() == before  # nothing trained, nothing logged
    assert not (tmp_path / "dpo_tiny").exists() or not list((tmp_path / "dpo_tiny").rglob("*.ckpt"))


def test_resume_at_max_steps_writes_the_missing_export(repo, finished_run, tmp_path):
    """A run killed during its final export (checkpoint at max_steps, only a temp folder of the export on disk)
    finishes on resume: the export is written, no step is trained or logged again."""
    run = copy_run(finished_run, tmp_path)
    shutil.rmtree(run / "hf_model")
    (run / ".hf_model.tmp-killed").mkdir()
    before = (run / "metrics.csv").read_text()
    out = run_to_end(repo, *quickstart(tmp_path, "--ckpt_path", "last"))
    assert "nothing left to train; writing the Hugging Face export" in out
    assert (run / "hf_model" / "model.safetensors").is_file()
    assert (run / "metrics.csv").read_text() == before


def test_truncated_checkpoint_is_named_with_the_others_of_its_folder(repo, finished_run, tmp_path):
    """--ckpt_path last on a truncated last.ckpt: one message naming the file, saying it is truncated or corrupt,
    and listing the other checkpoints of the run folder to resume from instead."""
    run = copy_run(finished_run, tmp_path)
    last = run / "checkpoints" / "last.ckpt"
    shutil.copy(last, run / "checkpoints" / "step=2.ckpt")
    last.write_bytes(last.read_bytes()[:4096])
    out = run_to_end(repo, *quickstart(tmp_path, "--ckpt_path", "last", steps=6), status=1)
    assert f"lightalign: error: Checkpoint '{last}' (4096 bytes) cannot be read" in out, out[-3000:]
    assert "truncated, corrupt" in out and f"Other checkpoints in {last.parent}: step=2.ckpt" in out
    assert "Traceback" not in out


def test_truncated_checkpoint_alone_says_start_anew(tmp_path):
    from lightalign.runs import read_checkpoint
    from lightalign.strategies.checkpoint_io import CheckpointError

    path = tmp_path / "last.ckpt"
    path.write_bytes(b"PK\x03\x04 not a whole zip")
    with pytest.raises(CheckpointError, match=r"truncated, corrupt or not a Lightning checkpoint. .* holds no other "
                                              r"checkpoint: start a new run without --ckpt_path"):
        read_checkpoint(path)


def test_resume_on_another_data_file_warns_and_continues(repo, finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path)
    data = tmp_path / "more.jsonl"
    data.write_text("\n".join((repo / "examples" / "data" / "arithmetic_sft.jsonl").read_text().splitlines()[:500]) + "\n")
    out = run_to_end(repo, *quickstart(tmp_path, "--data.path", str(data), "--ckpt_path", "last", steps=6))
    assert "was trained on 'examples/data/arithmetic_sft.jsonl'" in out and str(data) in out
    assert metric_steps(run) == list(range(6))


def test_unwritable_export_folder_fails_before_training(repo, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = run_to_end(repo, *quickstart(tmp_path, "--export.output_dir", str(blocker / "hf")), status=1)
    assert f"Cannot write the Hugging Face export to {blocker / 'hf'}" in out and "--export.output_dir" in out
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("metrics.csv"))  # stopped before training


@pytest.mark.parametrize("logger", ["wandb", "mlflow"])
def test_tracker_runs_get_one_folder_each(repo, tmp_path, logger):
    """With W&B (offline) or MLflow (the README's sqlite store, with the [dev] install) as the only logger, two runs
    of a config write into two lightalign run folders (version_0, version_1), and nothing lands in the logger's
    save_dir itself."""
    pytest.importorskip(logger)
    if logger == "wandb":
        spec = ["--trainer.logger", "lightning.pytorch.loggers.WandbLogger", "--trainer.logger.init_args.save_dir",
                str(tmp_path), "--trainer.logger.init_args.project", "proj", "--trainer.logger.init_args.offline", "true"]
        root = tmp_path / "proj"
    else:
        spec = ["--trainer.logger", "lightning.pytorch.loggers.MLFlowLogger", "--trainer.logger.init_args.experiment_name",
                "exp", "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
                "--trainer.logger.init_args.artifact_location", str(tmp_path / "mlartifacts"),
                "--trainer.default_root_dir", str(tmp_path)]
        root = tmp_path / "runs" / "exp"
    # W&B's variables keep it offline and inside tmp_path (read when the run starts: the runs are still forked from
    # the console server, no second import of torch and transformers per run); MLflow needs none
    extra_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path),
                 "WANDB_CONFIG_DIR": str(tmp_path), "WANDB_CACHE_DIR": str(tmp_path), "WANDB_DATA_DIR": str(tmp_path),
                 "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true"} if logger == "wandb" else {}
    args = ["fit", "--config", "configs/quickstart.yaml", *spec, "--trainer.max_steps", "2",
            "--trainer.limit_val_batches", "0", "--plot.enabled", "false"]
    run_to_end(repo, *args, extra_env=extra_env)
    run_to_end(repo, *args, extra_env=extra_env)
    for version in (0, 1):
        run = root / f"version_{version}"
        for name in ("config.yaml", "versions.json", "checkpoints/last.ckpt", "hf_model/model.safetensors"):
            assert (run / name).is_file(), f"{run}/{name}"
    assert not [p.name for p in tmp_path.iterdir() if p.name in ("hf_model", "config.yaml", "versions.json")]


def test_a_rollback_overwrites_last_so_ckpt_path_last_continues_the_new_branch(repo, tmp_path):
    """Resuming from an earlier checkpoint of the run and training on (another learning rate) leaves one last.ckpt,
    the new branch's: no last-v1.ckpt beside the abandoned branch's last.ckpt (mutation:
    checkpoint.enable_version_counter true -> last-v1.ckpt appears and last.ckpt is the old branch)."""
    run_to_end(repo, *quickstart(tmp_path, "--checkpoint.save_top_k", "-1"))
    checkpoints = tmp_path / "quickstart" / "version_0" / "checkpoints"
    step2 = next(checkpoints.glob("*step=2.ckpt"))
    run_to_end(repo, *quickstart(tmp_path, "--checkpoint.save_top_k", "-1", "--ckpt_path", str(step2),
                                 "--model.learning_rate", "5e-4"))
    assert sorted(p.name for p in checkpoints.glob("last*.ckpt")) == ["last.ckpt"]
    last = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 4 and last["hyper_parameters"]["learning_rate"] == 5e-4


def _seeded_teacher(tiny_dir: Path, folder: Path) -> Path:
    """A distillation teacher for the console runs: the tiny model's folder with seeded random weights."""
    from lightalign.hub import load_causal_lm

    shutil.copytree(tiny_dir, folder)
    torch.manual_seed(1)
    load_causal_lm(str(folder), from_config=True).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("config", ["distill_quickstart", "online_dpo_quickstart", "gold_quickstart"])
def test_a_sampling_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_weights(repo, tiny_dir, tmp_path,
                                                                                      config):
    """The shipped distillation (lmbda 0.5: each step draws whether the student samples or the data's completions
    are used), GOLD (the same draws; a student of another tokenizer than the teacher's, the ULD loss) and online DPO
    configs: a run SIGKILLed after its step-4 checkpoint, once later steps are logged, and
    continued by the same command (--ckpt_path last) exports the weights of an uninterrupted run, bit for bit: the
    lmbda draws and the samples after the checkpoint are the ones the uninterrupted run drew."""
    from safetensors.torch import load_file

    extra = []
    if config in ("distill_quickstart", "gold_quickstart"):  # gold's student has another tokenizer than this teacher
        extra = ["--model.teacher_model_name_or_path", str(_seeded_teacher(tiny_dir, tmp_path / "teacher"))]

    def args(save_dir: Path) -> list[str]:
        return ["fit", "--config", f"configs/{config}.yaml", "--trainer.max_steps", "12", "--data.batch_size", "4",
                "--trainer.limit_val_batches", "0", "--checkpoint.every_n_train_steps", "4",
                "--trainer.logger.init_args.save_dir", str(save_dir),
                "--trainer.logger.init_args.flush_logs_every_n_steps", "1", "--plot.enabled", "false",
                "--ckpt_path", "last", *extra]

    # the uninterrupted run and the run that gets killed are independent: side by side (the uninterrupted one forked
    # from the console server on a thread, the killed one a process group of its own)
    finished = {}
    uninterrupted = threading.Thread(target=lambda: finished.update(a=run_to_end(repo, *args(tmp_path / "a"))))
    uninterrupted.start()
    killed = lightalign(repo, *args(tmp_path / "b"))
    run = tmp_path / "b" / config / "version_0"
    deadline = time.monotonic() + 600
    while not ((run / "metrics.csv").is_file() and any(s >= 5 for s in metric_steps(run))):
        assert killed.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.02)
    os.killpg(killed.pid, signal.SIGKILL)
    finish(killed, -signal.SIGKILL)
    step = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"]
    assert step in (4, 8) and max(metric_steps(run)) >= step  # steps past the checkpoint were lost: redone
    uninterrupted.join()  # (one console-server call at a time)
    assert "a" in finished, "the uninterrupted run failed (its output is above)"
    out = run_to_end(repo, *args(tmp_path / "b"))
    assert f"Continuing run {run} from step {step}" in out
    a = load_file(tmp_path / "a" / config / "version_0" / "hf_model" / "model.safetensors")
    b = load_file(run / "hf_model" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    if config == "gold_quickstart":  # the cross-tokenizer loss ran (the fit-start line says the rows' layout)
        assert "padded rows (use_uld_loss" in out
    if config in ("distill_quickstart", "gold_quickstart"):  # both sources were drawn, so the draws mattered
        sources = [row["train/student_sampled"] for row in csv.DictReader(open(run / "metrics.csv")) if
                   row.get("train/student_sampled")]
        assert {float(v) for v in sources} == {0.0, 1.0}, sources
