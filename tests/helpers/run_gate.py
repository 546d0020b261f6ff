"""``PauseAtStep``: a callback that holds a console run under test at a known point, so the test acts on a run that
is known to be mid-way (owning its run folder, after a given checkpoint) instead of guessing with sleeps.

After optimizer step ``step`` (``on_train_batch_end``, before that step's ModelCheckpoint, which Lightning runs
last) it creates ``<folder>/reached`` and waits until ``<folder>/release`` exists (or ``timeout`` seconds, then it
raises). A test names it in a YAML passed as a second ``--config`` (``gate_config``), with tests/ on PYTHONPATH.
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L


class PauseAtStep(L.Callback):
    def __init__(self, step: int, folder: str, timeout: float = 600.0) -> None:
        self.step, self.folder, self.timeout, self.done = step, Path(folder), timeout, False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if self.done or trainer.global_step != self.step:
            return
        self.done = True
        (self.folder / "reached").touch()
        deadline = time.monotonic() + self.timeout
        while not (self.folder / "release").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"PauseAtStep: {self.folder / 'release'} did not appear in {self.timeout} s")
            time.sleep(0.05)


def gate_config(folder: Path, step: int) -> Path:
    """A YAML adding ``PauseAtStep(step, folder)`` to a run's callbacks (``--config`` it after the run's config)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "gate.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: helpers.run_gate.PauseAtStep\n      init_args:\n"
                      f"        step: {step}\n        folder: {folder}\n")
    return config


def wait_reached(folder: Path, proc, timeout: float = 600.0) -> None:
    """Wait until the gated run ``proc`` (a Popen) reached its step; fail if it ended first."""
    deadline = time.monotonic() + timeout
    while not (folder / "reached").exists():
        assert proc.poll() is None, f"the gated run ended (exit {proc.returncode}) before its step:\n" + \
            (proc.stdout.read()[-6000:] if proc.stdout else "")
        assert time.monotonic() < deadline, "the gated run did not reach its step"
        time.sleep(0.05)
