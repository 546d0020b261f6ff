"""Calling user code (reward functions, tools, environments) with a time limit.

A Python thread cannot be stopped from outside, so a call that outlives its limit is left running on a daemon
thread (it never keeps the process alive at exit) and the caller gets ``CallTimeout`` at once: a hanging reward
function or tool ends the run (or becomes an error message) in bounded time instead of stalling it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CallTimeout", "call_with_deadline", "map_with_deadline"]


class CallTimeout(TimeoutError):
    """A call did not return within its limit."""


class _Call:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.done = fn, threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="lightalign-user-call")

    def _run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller as it is
            self.error = err
        finally:
            self.done.set()


def call_with_deadline(fn: Callable[[], Any], timeout: float | None, what: str) -> Any:
    """``fn()``'s result, or its exception re-raised; ``CallTimeout`` naming ``what`` when it has not returned after
    ``timeout`` seconds (``None``: no limit, called on this thread)."""
    if timeout is None:
        return fn()
    return map_with_deadline([fn], timeout, [what])[0]


def map_with_deadline(fns: Sequence[Callable[[], Any]], timeout: float | None, whats: Sequence[str],
                      return_errors: bool = False) -> list[Any]:
    """Every ``fns[i]()`` at once (one daemon thread each), all within ``timeout`` seconds from the start.

    Returns the results in order. A call that raised or timed out re-raises (the first in order; ``CallTimeout``
    naming ``whats[i]`` for a timeout), or, with ``return_errors``, stands in the list as its exception."""
    if timeout is None and len(fns) == 1 and not return_errors:
        return [fns[0]()]
    calls = [_Call(fn) for fn in fns]
    for call in calls:
        call.thread.start()
    deadline = None if timeout is None else _now() + timeout
    out: list[Any] = []
    for call, what in zip(calls, whats):
        left = None if deadline is None else max(0.0, deadline - _now())
        if not call.done.wait(left):
            err: BaseException = CallTimeout(f"{what} did not return within {timeout:g} s")
        elif call.error is not None:
            err = call.error
        else:
            out.append(call.value)
            continue
        if not return_errors:
            raise err
        out.append(err)
    return out


def _now() -> float:
    return time.monotonic()
