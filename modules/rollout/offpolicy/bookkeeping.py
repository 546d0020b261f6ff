"""``RolloutsAhead``: the bookkeeping every sampler ahead shares (the sampling process of ``AheadSampler``, the
vLLM server of ``EngineAhead``): which rollouts were asked for with which weights, which are done, the time the
training process waited for them, and the rollouts not yet trained that a checkpoint keeps. A sampler says only
how to wait for one rollout (``_wait_for``)."""

from __future__ import annotations

import time
from typing import Any

from lightalign.process_death import ProcessDiedError


class SamplerProcessError(RuntimeError):
    """The sampler ahead failed or exited; the message carries its traceback, exit code or error."""


class SamplerProcessDied(SamplerProcessError, ProcessDiedError):
    """The sampling process ended while the run waited for it (killed, or exited without a reply): one line naming
    it, its pid and its signal or exit code, and that ``--ckpt_path last`` resumes (``lightalign.process_death``)."""


class RolloutsAhead:
    depth: int

    def __init__(self) -> None:
        self.in_flight: dict[int, int] = {}  # rollout index -> the optimizer step of its weights
        self.done: dict[int, dict[str, Any]] = {}  # rollout index -> {"rollout", "version", "seconds"}
        self.waited = 0.0  # seconds the training process waited for rollouts (idle), since the last read

    def _wait_for(self, index: int) -> None:
        """Block until rollout ``index`` (in flight or done) is in ``done``."""
        raise NotImplementedError

    def pending(self) -> set[int]:
        """Rollouts asked for and not taken yet (in flight or done)."""
        return set(self.in_flight) | set(self.done)

    def take(self, index: int) -> tuple[dict[str, Any], int, float]:
        """Rollout ``index``: ``(rollout, optimizer step of its weights, seconds it took to sample)``."""
        if index not in self.done:
            if index not in self.in_flight:
                raise SamplerProcessError(f"Rollout {index} was never asked for (pending: {sorted(self.pending())}).")
            start = time.perf_counter()
            self._wait_for(index)
            self.waited += time.perf_counter() - start
        entry = self.done.pop(index)
        return entry["rollout"], entry["version"], entry["seconds"]

    def drain(self) -> None:
        """Wait for every rollout in flight."""
        for index in sorted(self.in_flight):
            self._wait_for(index)

    def state_dict(self) -> dict[str, Any]:
        """The rollouts asked for and not yet taken, finished (waits for those in flight)."""
        self.drain()
        return {"ahead_rollouts": {i: dict(entry) for i, entry in self.done.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = {int(i): dict(entry) for i, entry in state.get("ahead_rollouts", {}).items()}
        self.in_flight.clear()
