"""A DDP rank that dies under a plainly launched multi-process run, said in one line by the main process.

Lightning's subprocess launcher (``_SubprocessScriptLauncher``: ``--trainer.devices N`` without torchrun or SLURM)
starts ranks 1..N-1 of each node as child processes of that node's rank 0. When one is killed (the out-of-memory
killer, a ``kill``), rank 0 meets the death at its next collective: gloo raises ``Connection reset by peer`` with
a traceback that never says which rank died; and Lightning's child-process observer, which polls every 5 s, then
SIGKILLs every process of the node, rank 0 included, so depending on timing rank 0 even ends without a word.

``watch_ranks(trainer)`` (``LightalignCLI.before_fit``, before the launch) gives the trainer's strategy a
``RankWatchingLauncher``: Lightning's launcher with ``RankWatch`` instead of that observer. ``RankWatch`` records the
first child that ends with a non-zero status (its global rank, pid, exit code or signal) and SIGKILLs the node's other
children (left alone, they would wait in their collectives until the timeout). ``rank_death(trainer, err)``, on
the error that ended rank 0's fit, answers a ``ProcessDiedError`` naming that rank when one did die (waiting a few
seconds for the death to be seen when ``err`` is a collective's error: the socket closes before the process can be
waited for), and None otherwise: an error with every rank alive is left as it is. Should rank 0 stay blocked
(a collective that does not fail), ``RankWatch`` prints the line itself after ``GRACE_S`` and exits with status 1.

Only the ranks this process started are watched: a rank of another node, or of a torchrun/SLURM launch, is not
its child.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lightalign.process_death import ProcessDiedError, died

POLL_S = 0.2  # how often the children's statuses are read
WAIT_S = 10.0  # how long rank 0, failed in a collective, waits for a child's death to be seen
GRACE_S = 30.0  # how long rank 0 may stay blocked after a death before the watch ends it
COLLECTIVE_ERROR = re.compile(r"gloo|nccl|connection reset|connection closed|broken pipe|socket", re.IGNORECASE)


class RankWatch(threading.Thread):
    """Polls the node's child ranks (``procs[i]`` is global rank ``first_rank + i``); see the module docstring."""

    def __init__(self, procs: list[subprocess.Popen], first_rank: int) -> None:
        super().__init__(daemon=True, name="lightalign-rank-watch")
        self.procs, self.first_rank = procs, first_rank
        self.death: tuple[int, int, int] | None = None  # (global rank, pid, exit status) of the first child that died
        self.seen = threading.Event()
        self.claimed = False  # the main thread reports the death itself
        self.finished = False
        self._lock = threading.Lock()

    def check(self) -> tuple[int, int, int] | None:
        """The first child that ended with a non-zero status, polling them now (None: none did)."""
        with self._lock:
            if self.death is None:
                for i, proc in enumerate(self.procs):
                    if proc.poll() not in (None, 0):
                        self.death = (self.first_rank + i, proc.pid, proc.returncode)
                        self.seen.set()
                        break
            return self.death

    def run(self) -> None:
        while not self.finished and self.check() is None:
            if all(proc.poll() == 0 for proc in self.procs):
                return  # every child finished its run
            time.sleep(POLL_S)
        if self.finished:
            return
        for proc in self.procs:  # the survivors would wait in their next collective until its timeout
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            with self._lock:
                if self.claimed or self.finished:
                    return
        with self._lock:
            if self.claimed:
                return
            self.claimed = True
        rank, pid, code = self.death
        print(f"lightalign: error: {died(f'DDP rank {rank}', pid, code, 'the run was training')}", file=sys.stderr,
              flush=True)
        os._exit(1)

    def claim(self, wait: float) -> tuple[int, int, int] | None:
        """The death, if one is seen within ``wait`` seconds; the watch then leaves reporting it to the caller."""
        if self.check() is None and wait > 0:
            self.seen.wait(wait)
        death = self.check()
        if death is not None:
            with self._lock:
                if self.claimed:  # the watch is already reporting it and exiting
                    return None
                self.claimed = True
        return death


class RankWatchingLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher with ``RankWatch`` in place of its observer (``watch`` once launched)."""

    watch: RankWatch | None = None

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            node = self.cluster_environment.node_rank()
            self.watch = RankWatch(self.procs, first_rank=node * self.num_processes + 1)
            self.watch.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        finally:
            if self.watch is not None and self.watch.death is None:
                self.watch.finished = True


def watch_ranks(trainer: Any) -> None:
    """Give ``trainer``'s strategy a ``RankWatchingLauncher`` if it launches its ranks with Lightning's own."""
    strategy = trainer.strategy
    launcher = getattr(strategy, "_launcher", None)
    if type(launcher) is _SubprocessScriptLauncher:
        strategy._launcher = RankWatchingLauncher(launcher.cluster_environment, launcher.num_processes,
                                                  launcher.num_nodes)


def rank_death(trainer: Any, err: BaseException) -> ProcessDiedError | None:
    """A ``ProcessDiedError`` naming the child rank that died, when ``err`` ended the fit after one did (None when
    every rank is alive, or this process started none)."""
    watch = getattr(getattr(trainer.strategy, "_launcher", None), "watch", None)
    if watch is None:
        return None
    death = watch.claim(WAIT_S if is_collective_error(err) else 0.0)
    if death is None:
        return None
    rank, pid, code = death
    return ProcessDiedError(died(f"DDP rank {rank}", pid, code, f"the run was training (step {trainer.global_step} "
                                                                "done)"))


def is_collective_error(err: BaseException | None) -> bool:
    """``err`` or an error it was raised from is a failed collective (torch.distributed's, or gloo's/NCCL's text)."""
    import torch.distributed as dist

    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and COLLECTIVE_ERROR.search(str(err))):
            return True
        err = err.__cause__ or err.__context__
    return False
