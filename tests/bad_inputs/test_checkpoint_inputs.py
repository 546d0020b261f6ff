"""Checkpoints: atomic saves survive a kill mid-write, full disks and corrupt files give clear errors, a resume
with another method or model is refused by name, and non-finite gradients are skipped or stop the run."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import console_script
from lightalign import AtomicCheckpointIO, CheckpointError, DPOModule, PreferenceDataModule, SFTDataModule, SFTModule

WORKER = Path(__file__).resolve().parents[1] / "workers" / "resume_worker.py"


def _sft(tiny_dir, data_dir, **kw):
    return (SFTModule(str(tiny_dir), from_config=True, learning_rate=1e-3, **kw),
            SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4))


def _trainer(tmp_path=None, **kw):
    kw.setdefault("max_steps", 2)
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, plugins=[AtomicCheckpointIO()], **kw)


@pytest.fixture
def sft_checkpoint(tiny_dir, data_dir, tmp_path):
    module, data = _sft(tiny_dir, data_dir)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    _trainer(max_steps=2, callbacks=[ckpt]).fit(module, data)
    return tmp_path / "ckpt" / "last.ckpt"


def test_kill_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    # the worker forked from the console server (tests/helpers/console_script.py), as `python WORKER ...` would run
    proc = console_script.run_python(WORKER, "--method", "sft", "--out", str(tmp_path), "--max-steps", "6", "--every",
                                     "2", "--die-during-save", "4", timeout=600)
    assert proc.returncode == -9, proc.stderr[-2000:]
    left = list((tmp_path / "ckpt").glob(".*.tmp-*"))
    assert left  # the interrupted write went to a temporary name
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 2  # the previous good checkpoint, intact
    # the next load (a resume) deletes the dead process's temporary file
    AtomicCheckpointIO().load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert not any(p.exists() for p in left)


def test_stale_temporaries_of_dead_processes_are_removed_at_the_next_save(tmp_path):
    import socket

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, host = int(dead.stdout), socket.gethostname()
    try:
        files = {
            "dead": tmp_path / f".last.ckpt.tmp-{host}-{dead_pid}",
            "dead_old_name": tmp_path / f".step=4.ckpt.tmp-{dead_pid}",
            "alive": tmp_path / f".last.ckpt.tmp-{host}-{sleeper.pid}",
            "other_host": tmp_path / f".last.ckpt.tmp-not-{host}-{dead_pid}",
            "not_a_pid": tmp_path / ".last.ckpt.tmp-abc",
        }
        for f in files.values():
            f.write_bytes(b"partial")
        AtomicCheckpointIO().save_checkpoint({"x": 1}, tmp_path / "last.ckpt")
        assert {k for k, f in files.items() if f.exists()} == {"alive", "other_host", "not_a_pid"}
        assert torch.load(tmp_path / "last.ckpt", weights_only=True) == {"x": 1}
    finally:
        sleeper.kill()
        sleeper.wait()


def test_out_of_disk_keeps_previous_checkpoint(sft_checkpoint, monkeypatch):
    before = sft_checkpoint.read_bytes()

    def full_disk(obj, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"Out of disk space while writing checkpoint .*last.ckpt.*previous checkpoint is untouched"):
        AtomicCheckpointIO().save_checkpoint({"x": 1}, sft_checkpoint)
    assert sft_checkpoint.read_bytes() == before
    assert not list(sft_checkpoint.parent.glob(".*.tmp-*"))


def test_truncated_checkpoint_is_named(sft_checkpoint, tiny_dir, data_dir):
    data = sft_checkpoint.read_bytes()
    sft_checkpoint.write_bytes(data[: len(data) // 3])
    module, dm = _sft(tiny_dir, data_dir)
    with pytest.raises(CheckpointError, match=r"last.ckpt' \(\d+ bytes\) cannot be read: it is truncated or corrupt"):
        _trainer(max_steps=3).fit(module, dm, ckpt_path=str(sft_checkpoint))


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "nope.ckpt")


def test_checkpoints_load_with_weights_only(sft_checkpoint):
    ckpt = torch.load(sft_checkpoint, weights_only=True)  # no pickled Python objects in our checkpoints
    assert ckpt["lightalign_meta"]["module"] == "SFTModule" and "lightalign_rng" in ckpt


def test_resume_with_another_method_is_refused(sft_checkpoint, tiny_dir, data_dir):
    module = DPOModule(str(tiny_dir), from_config=True)
    data = PreferenceDataModule(str(data_dir / "arithmetic_preference.jsonl"), tokenizer=str(tiny_dir), batch_size=4)
    with pytest.raises(ValueError, match="written by SFTModule, not DPOModule"):
        _trainer(max_steps=3).fit(module, data, ckpt_path=str(sft_checkpoint))


def test_resume_with_another_model_is_refused(sft_checkpoint, repo, data_dir):
    llama = repo / "assets" / "models" / "tiny-llama"
    module = SFTModule(str(llama), from_config=True)
    data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(llama), batch_size=4)
    with pytest.raises(ValueError, match="The checkpoint holds another model"):
        _trainer(max_steps=3).fit(module, data, ckpt_path=str(sft_checkpoint))


class _PoisonGrad(L.Callback):
    """Turns one gradient into NaN at a given optimizer step."""

    def __init__(self, step):
        self.step = step

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.step:
            next(p for p in pl_module.parameters() if p.grad is not None).grad[0].fill_(float("nan"))


def test_nonfinite_gradient_skips_the_step(tiny_dir, data_dir):
    module, data = _sft(tiny_dir, data_dir, weight_decay=0.1)
    snapshots = {}

    class Snap(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            snapshots[trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    with pytest.warns(UserWarning, match=r"Skipped optimizer step 1 \(epoch 0, batch 1\).*non-finite gradient \(1 skipped"):
        _trainer(max_steps=4, callbacks=[Snap(), _PoisonGrad(1)], enable_checkpointing=False).fit(module, data)
    # the step counter moved on, but the weights did not change during the poisoned step
    assert all(torch.equal(snapshots[1][n], snapshots[2][n]) for n in snapshots[1])
    assert not all(torch.equal(snapshots[2][n], snapshots[3][n]) for n in snapshots[2])
    assert module.nonfinite_steps == 1
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_nonfinite_gradient_stop_names_step_batch_and_parameter(tiny_dir, data_dir):
    module, data = _sft(tiny_dir, data_dir, nonfinite="stop")
    with pytest.raises(FloatingPointError, match=r"Non-finite gradient at optimizer step 2 \(epoch 0, batch 2\), first in parameter 'model\."):
        _trainer(max_steps=4, callbacks=[_PoisonGrad(2)], enable_checkpointing=False).fit(module, data)


def test_consecutive_nonfinite_steps_stop_the_run(tiny_dir, data_dir):
    module, data = _sft(tiny_dir, data_dir, max_consecutive_nonfinite_steps=3)

    class PoisonFrom(_PoisonGrad):
        def on_after_backward(self, trainer, pl_module):
            if trainer.global_step >= self.step:
                next(p for p in pl_module.parameters() if p.grad is not None).grad[0].fill_(float("inf"))

    with pytest.warns(UserWarning, match="Skipped optimizer step"):
        with pytest.raises(FloatingPointError, match=r"3 optimizer steps in a row had non-finite gradients \(the last "
                                                     r"at optimizer step 3 .*max_consecutive_nonfinite_steps"):
            _trainer(max_steps=8, callbacks=[PoisonFrom(1)], enable_checkpointing=False).fit(module, data)
    assert module.nonfinite_steps == 3


class _PoisonWeight(L.Callback):
    """Turns one weight into inf after the optimizer step of a given step (an update that overflowed)."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                dict(pl_module.named_parameters())["model.model.layers.1.mlp.up_proj.weight"][0, 0] = float("inf")


def test_nonfinite_weights_stop_the_run_before_any_checkpoint(tiny_dir, data_dir, tmp_path):
    module, data = _sft(tiny_dir, data_dir)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)
    with pytest.raises(FloatingPointError, match=r"Non-finite weights after optimizer step 2 \(epoch 0\): parameter "
                                                 r"'model.model.layers.1.mlp.up_proj.weight' holds NaN/inf. The step's "
                                                 r"gradients were finite"):
        _trainer(max_steps=4, callbacks=[_PoisonWeight(2), ckpt]).fit(module, data)
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 1  # the last good state


@pytest.mark.parametrize("values, finite", [
    ([1.0, -2.0], True),
    ([1e30, -1e30], True),  # finite, but the 2-norm's squares overflow: the max-abs decides
    ([float("nan"), 1.0], False),
    ([float("inf"), 1.0], False),
    ([-float("inf"), 1e30], False),
    ([float("nan"), 1e30], False),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_all_finite_is_exact_whatever_the_magnitudes(values, finite, dtype):
    """The guard's weight check (``all_finite``: a 2-norm first, the max-abs only when that is not finite) says
    finite exactly when every value is, also when the squares overflow (float16: already at 1e30 -> inf on cast,
    so only the NaN/inf rows and the small ones apply there)."""
    from lightalign.callbacks.nonfinite import all_finite

    big = torch.tensor(values, dtype=torch.float32)
    if dtype == torch.float16 and big.abs().max() > 6e4 and finite:
        big = torch.tensor([6e4, -6e4], dtype=torch.float16)  # finite float16 whose squares overflow
    tensors = [torch.ones(3, dtype=dtype), big.to(dtype), torch.zeros(0, dtype=dtype)]
    assert all_finite(tensors) is finite


def test_nonfinite_weights_are_never_checkpointed_or_exported(tiny_dir, data_dir, tmp_path):
    module, data = _sft(tiny_dir, data_dir, nonfinite="off")  # no per-step checks: the save itself refuses
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    with pytest.raises(FloatingPointError, match=r"Non-finite weights in the checkpoint of step 2: parameter "
                                                 r"'model\.model\..*' holds NaN/inf\. The checkpoint is not written"):
        _trainer(max_steps=4, callbacks=[_PoisonWeight(1), ckpt]).fit(module, data)
    assert not list(tmp_path.glob("*.ckpt"))
    with pytest.raises(FloatingPointError, match=r"Refusing to export to .*hf_model': parameter '.*' holds NaN/inf"):
        module.export_hf(tmp_path / "hf_model")
    assert not (tmp_path / "hf_model").exists()


def test_exploding_learning_rate_exits_with_an_error_and_no_export(repo, tiny_dir, data_dir, tmp_path):
    """lr 1e38: finite gradients, then the update makes the weights infinite. The run must fail naming the step
    and the parameter in one line (exit 1, no traceback), and write no Hugging Face model (the console script, as a
    user runs it)."""
    lines = (data_dir / "arithmetic_sft.jsonl").read_text().splitlines()[:32]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    proc = console_script.run(tmp_path, "fit", "--config", str(repo / "configs" / "quickstart.yaml"),
                              "--model.model_name_or_path", str(tiny_dir), "--model.init_args.learning_rate", "1e38",
                              "--data.path", str(tmp_path / "train.jsonl"), "--data.val_path", "null",
                              "--data.batch_size", "4", "--trainer.max_steps", "20", "--plot.enabled", "false",
                              "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lightalign: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]  # one line, no traceback
    assert errors[0].startswith("lightalign: error: Non-finite weights after optimizer step 2 (epoch 0): parameter "
                                "'model."), errors[0]
    assert not list((tmp_path / "runs").rglob("hf_model")) and not list((tmp_path / "runs").rglob("*.safetensors"))


def test_unknown_nonfinite_policy():
    with pytest.raises(ValueError, match="nonfinite='ignore' is unknown"):
        SFTModule("m", nonfinite="ignore")
