"""One owner per run folder (``lightalign/run_lock.py``, ``RunFolder.take``): through the ``lightalign`` console
script, as users meet it — two runs on one folder, a double ``--ckpt_path last``, a killed owner, ``--ckpt_path`` given
a folder, a leftover folder that holds only a config.

The run that must be mid-way when the second one starts is held at a known step by ``helpers.run_gate.PauseAtStep``
(no sleeps to guess timing); it runs as a subprocess of its own with tests/ on PYTHONPATH, the second run is forked
from the console server (tests/helpers/console_script.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from helpers import console_script
from helpers.run_folders import copy_run, finished_quickstart, metric_steps, quickstart, run_to_end
from helpers.run_gate import gate_config, wait_reached

pytestmark = pytest.mark.slow
LIGHTALIGN = Path(sys.executable).with_name("lightalign")  # the venv's console script




def gated(repo: Path, log: Path, *args: str) -> subprocess.Popen:
    """The console script in a process group of its own, tests/ importable (the gate), output to ``log``."""
    env = console_script.tests_env()
    with open(log, "w") as out:
        return subprocess.Popen([str(LIGHTALIGN), *args], cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)


def finish(proc: subprocess.Popen, log: Path, status: int = 0) -> str:
    proc.wait(timeout=900)
    out = log.read_text()
    assert proc.returncode == status, f"exit {proc.returncode} (expected {status})\n{out[-6000:]}"
    return out




error_line = console_script.error_line




def files_of(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and mtime."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(repo, tmp_path_factory) -> Path:
    return finished_quickstart(repo, tmp_path_factory.mktemp("finished"))




def test_a_second_run_on_an_explicit_version_in_use_is_refused_and_the_first_keeps_everything(repo, tmp_path):
    """The trial's case: two runs with one explicit name/version, the second with another learning rate, started
    while the first trains. The second is refused in one line naming the first's pid, host and start, before it writes
    anything; the first ends with its own config.yaml and every step once in metrics.csv (mutation: the claim in
    fit_run skipped -> the second writes into the folder and fails on the first's metrics.csv)."""
    version = ["--trainer.logger.init_args.name", "X", "--trainer.logger.init_args.version", "0"]
    gate = tmp_path / "gate"
    log = tmp_path / "first.log"
    first = gated(repo, log, *quickstart(tmp_path, *version, "--config", str(gate_config(gate, 3)), steps=8))
    run = tmp_path / "X" / "version_0"
    try:
        wait_reached(gate, first)
        before = files_of(run)
        out = run_to_end(repo, *quickstart(tmp_path, *version, "--model.learning_rate", "1e-3", steps=8), status=1)
        assert error_line(out).startswith(f"lightalign: error: Run folder {run} is in use by another run: pid "
                                          f"{first.pid} on host {socket.gethostname()} since "), out[-3000:]
        assert "Traceback" not in out
        assert files_of(run) == before  # nothing written into the owner's folder
        (gate / "release").touch()
        # the claim wrote nothing into the new folder: Lightning's CSV logger found it empty, no warning
        assert "exists and is not empty" not in finish(first, log)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert metric_steps(run) == list(range(8))  # every step once: nothing replaced, nothing doubled
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["init_args"]["learning_rate"] == 3e-3
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]  # the lock file is gone: given back


def test_two_resumes_of_one_run_one_continues_the_other_is_refused(repo, finished_run, tmp_path):
    """A double requeue: two ``--ckpt_path last`` of one run. The one that claimed the run continues it; the other is
    refused naming it, so steps 4-7 are trained and logged once."""
    run = copy_run(finished_run, tmp_path)
    gate = tmp_path / "gate"
    log = tmp_path / "first.log"
    first = gated(repo, log, *quickstart(tmp_path, "--ckpt_path", "last", "--config", str(gate_config(gate, 6)),
                                         steps=8))
    try:
        wait_reached(gate, first)
        out = run_to_end(repo, *quickstart(tmp_path, "--ckpt_path", "last", steps=8), status=1)
        assert error_line(out).startswith(f"lightalign: error: Run folder {run} is in use by another run: pid "
                                          f"{first.pid} on host {socket.gethostname()} since "), out[-3000:]
        assert "Continuing run" not in out
        (gate / "release").touch()
        assert f"Continuing run {run} from step 4" in finish(first, log)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert metric_steps(run) == list(range(8))
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]


def test_a_folder_whose_owner_was_killed_is_taken_over_by_the_next_resume(repo, tmp_path):
    """SIGKILL mid-run leaves the lock file (the kernel dropped the lock): ``--ckpt_path last`` takes the folder over,
    saying whose it was, and continues from the checkpoint (mutation: a dead owner on this host taken for live ->
    refused)."""
    gate = tmp_path / "gate"
    log = tmp_path / "first.log"
    run = tmp_path / "quickstart" / "version_0"
    first = gated(repo, log, *quickstart(tmp_path, "--ckpt_path", "last", "--config", str(gate_config(gate, 5)),
                                         steps=8))
    try:
        wait_reached(gate, first)  # after the step-4 checkpoint
    finally:
        os.killpg(first.pid, signal.SIGKILL)
    finish(first, log, -signal.SIGKILL)
    assert (run.parent / ".version_0.lock").is_file()
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"] == 4
    out = run_to_end(repo, *quickstart(tmp_path, "--ckpt_path", "last", steps=8))
    assert (f"Run folder {run}: taking it over from pid {first.pid} on host {socket.gethostname()} since " in out
            and "which is gone" in out), out[-3000:]
    assert f"Continuing run {run} from step 4" in out
    assert metric_steps(run) == list(range(8))
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]


def test_ckpt_path_names_a_folder(repo, finished_run, tmp_path):
    """``--ckpt_path`` given a run folder's checkpoints/ or the run folder continues its last.ckpt, and says so; a
    folder without one is refused as a folder, naming the checkpoints it holds."""
    run = copy_run(finished_run, tmp_path)
    out = run_to_end(repo, *quickstart(tmp_path, "--ckpt_path", str(run / "checkpoints"), steps=6))
    assert f"--ckpt_path {run / 'checkpoints'} is a folder: resuming from its last.ckpt." in out
    assert f"Continuing run {run} from step 4" in out and metric_steps(run) == list(range(6))
    out = run_to_end(repo, *quickstart(tmp_path, "--ckpt_path", str(run), steps=6), status=1)  # now at step 6
    assert f"--ckpt_path {run} is a folder: resuming from its checkpoints/last.ckpt." in out
    assert "is at step 6 = --trainer.max_steps: that run is finished" in error_line(out)
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "checkpoints" / "last.ckpt", other / "checkpoints" / "step=6.ckpt")
    for folder, held in ((other, "Pass one of its checkpoints: checkpoints/step=6.ckpt."), (tmp_path / "gate", None)):
        folder.mkdir(exist_ok=True)
        line = error_line(run_to_end(repo, *quickstart(tmp_path, "--ckpt_path", str(folder), steps=8), status=1))
        assert line.startswith(f"lightalign: error: --ckpt_path '{folder}' is a folder, not a checkpoint file"), line
        assert "does not exist" not in line and (held is None or held in line), line


def test_a_leftover_folder_holding_only_a_config_is_not_taken_for_a_run(repo, finished_run, tmp_path):
    """A run refused at fit start (or failing in its first rollout) leaves version_N with config.yaml and
    versions.json only. ``--ckpt_path last`` continues the newest run with a checkpoint, the export lookup passes it
    over, and a new run takes the next number."""
    from lightalign.runs import latest_export

    run = copy_run(finished_run, tmp_path)
    leftover = run.with_name("version_1")
    leftover.mkdir()
    for name in ("config.yaml", "versions.json"):
        shutil.copy(run / name, leftover / name)
    out = run_to_end(repo, *quickstart(tmp_path, "--ckpt_path", "last", steps=6))
    assert f"Continuing run {run} from step 4" in out
    assert sorted(p.name for p in leftover.iterdir()) == ["config.yaml", "versions.json"]  # untouched
    assert latest_export(run.parent) == run / "hf_model"
    run_to_end(repo, *quickstart(tmp_path, steps=2))
    assert (run.with_name("version_2") / "checkpoints" / "last.ckpt").is_file()


def test_a_refusal_reaches_every_node_of_a_multi_node_run(repo, tmp_path):
    """A two-node run (one process per node, started apart as on a cluster: NODE_RANK 0 and 1, gloo on CPU) aimed at a
    folder another run owns: rank 0 is refused, the refusal is broadcast at the first point both ranks meet, and both
    exit 1 with the same line, none waiting for the other (mutation: rank 0 raises at once -> rank 1 waits for it at
    the process group and the test times out)."""
    from lightalign.run_lock import RunLock

    run = tmp_path / "X" / "version_0"
    holder = RunLock.acquire(run)  # this test process owns the folder
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = quickstart(tmp_path, "--trainer.logger.init_args.name", "X", "--trainer.logger.init_args.version", "0",
                      "--trainer.num_nodes", "2", "--trainer.strategy", "ddp", steps=2)
    procs = []
    try:
        for node in (0, 1):
            env = console_script.standard_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node))
            procs.append(subprocess.Popen([str(LIGHTALIGN), *args], cwd=repo, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outs = [proc.communicate(timeout=240)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        holder.release()
    for node, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode == 1, f"node {node}: exit {proc.returncode}\n{out[-4000:]}"
        assert error_line(out).startswith(f"lightalign: error: Run folder {run} is in use by another run: pid "
                                          f"{os.getpid()} on host {socket.gethostname()} since "), out[-3000:]
    assert not run.exists()  # nothing written


def test_another_hosts_lock_file_is_live_while_refreshed_and_stale_after(tmp_path, monkeypatch):
    """The rule for a lock file naming another host (flock may not span hosts): its owner is alive while the file's
    mtime advances, gone once it was not refreshed for STALE_AFTER_S (mutation: the age not checked -> the fresh
    record is taken over)."""
    import json

    from lightalign import run_lock

    monkeypatch.setattr(run_lock, "STALE_AFTER_S", 5.0)
    run = tmp_path / "version_0"
    record = {"pid": 1, "host": "another-node", "since": "2025-01-01T00:00:00+00:00"}
    run_lock.lock_path(run).write_text(json.dumps(record))
    waits = []

    def refreshed(seconds):  # the other host's owner refreshes its file while the claim watches
        waits.append(seconds)
        os.utime(run_lock.lock_path(run))

    with pytest.raises(run_lock.RunInUseError, match="pid 1 on host another-node since 2025-01-01"):
        run_lock.RunLock.acquire(run, wait=refreshed)
    assert waits and json.loads(run_lock.lock_path(run).read_text()) == record  # the live owner's record kept
    old = time.time() - 6
    os.utime(run_lock.lock_path(run), (old, old))
    said = []
    lock = run_lock.RunLock.acquire(run, wait=lambda s: pytest.fail("no wait for a stale record"), info=said.append)
    assert lock.previous == record and "taking it over from pid 1 on host another-node" in said[-1]
    lock.release()
    assert not run_lock.lock_path(run).exists()


def test_a_new_run_on_an_explicit_version_of_a_finished_run_is_refused(repo, finished_run, tmp_path):
    """No run holds the folder any more, but it holds a run: a new run with its explicit version (Lightning's CSV
    logger would delete its metrics.csv) is refused before anything is written; the same version with
    ``--ckpt_path last`` continues it (mutation: the outputs check dropped -> the finished run's metrics replaced)."""
    run = copy_run(finished_run, tmp_path)
    before = files_of(run)
    explicit = ["--trainer.logger.init_args.version", "0"]
    line = error_line(run_to_end(repo, *quickstart(tmp_path, *explicit, "--model.learning_rate", "1e-3"), status=1))
    assert line.startswith(f"lightalign: error: {run} holds a run already (metrics.csv, checkpoints, hf_model)"), line
    assert "--ckpt_path last" in line
    assert files_of(run) == before and sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    out = run_to_end(repo, *quickstart(tmp_path, *explicit, "--ckpt_path", "last", steps=6))
    assert f"Continuing run {run} from step 4" in out and metric_steps(run) == list(range(6))
