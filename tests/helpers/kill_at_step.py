"""Callbacks that kill a process of a console run under test at a known optimizer step, from inside the run, so a
test of what the run says about a dead process needs no timing guess (no sleeps, no polling for pids).

``KillSampler(step)``: SIGKILLs the sampling process of asynchronous rollouts (``max_staleness > 0``) after optimizer
step ``step``; the run then waits for a rollout that never comes. ``KillRank(step, rank)``: rank ``rank`` of a DDP
run SIGKILLs itself after optimizer step ``step`` (its peers meet the death at their next collective).
``FailOnRank(step, rank)``: rank ``rank`` raises ``RuntimeError("FailOnRank: ...")`` there instead (a real error, every
rank alive). A test names
one in a YAML passed as a second ``--config`` (``kill_config``), with tests/ on PYTHONPATH.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L


class KillSampler(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        ahead = pl_module.off_policy.ahead
        if trainer.global_step == self.step and ahead is not None and ahead.process is not None:
            os.kill(ahead.process.pid, signal.SIGKILL)
            ahead.process.join(timeout=60)  # dead before the run goes on: the next wait meets a dead process


class KillRank(L.Callback):
    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


class FailOnRank(KillRank):
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            raise RuntimeError(f"FailOnRank: rank {self.rank} fails after step {self.step}")


def kill_config(folder: Path, class_name: str, **init_args: int) -> Path:
    """A YAML adding ``helpers.kill_at_step.<class_name>(**init_args)`` to a run's callbacks."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / f"{class_name}.yaml"
    args = "".join(f"        {k}: {v}\n" for k, v in init_args.items())
    config.write_text(f"trainer:\n  callbacks:\n    - class_path: helpers.kill_at_step.{class_name}\n"
                      f"      init_args:\n{args}")
    return config
