"""Calling the reward functions of a rollout: one call per function on the whole batch (as TRL calls them), all
functions at once, each within a time limit; and, when a call raised, finding the row that fails alone.

Each call runs on a daemon thread (``deadline.map_with_deadline``) with the caller's torch state that is kept per
thread (grad mode, inference mode, the current CUDA device): a reward model called under ``no_grad`` on rank 3's GPU
runs that way on its thread too. A call that outlives its limit keeps running on its thread (Python cannot stop a
thread), but the rollout no longer waits for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightalign.rewards.deadline import CallTimeout, call_with_deadline, map_with_deadline

__all__ = ["CallTimeout", "call_reward_functions", "describe_failed_call", "short_repr"]

TIMEOUT_KNOB = "model.reward_timeout"


class RewardFunctionError(RuntimeError):
    """A reward function failed or returned something unusable; the message names the function and the row."""


def short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _call(fn: Callable, prompts: list, completions: list, columns: dict[str, Any]) -> Any:
    out = fn(prompts=prompts, completions=completions, **columns)
    if inspect.isawaitable(out):  # async reward functions (e.g. an LLM judge)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(out)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, out).result()
    return out


def _with_callers_torch_state(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` to run on another thread under this thread's grad mode, inference mode and CUDA device."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def run() -> Any:
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return call()

    return run


def call_reward_functions(funcs: Sequence[Callable], names: Sequence[str], prompts: list, completions: list,
                          columns: dict[str, Any], timeout: float | None) -> list[Any]:
    """Every function called once on the whole batch, all at once, within ``timeout`` seconds from the start
    (``None``: no limit). Each entry is the function's output, or the ``Exception`` it raised (``CallTimeout`` when
    it had not returned in time). Anything else it raised (``KeyboardInterrupt``, ``SystemExit``) is re-raised."""
    calls = [_with_callers_torch_state(lambda fn=fn: _call(fn, prompts, completions, columns)) for fn in funcs]
    whats = [f"Reward function '{name}'" for name in names]
    results = map_with_deadline(calls, timeout, whats, return_errors=True)
    for what, result in zip(whats, results):
        if isinstance(result, SystemExit):  # e.g. argparse inside the function: the run must say which one
            raise RewardFunctionError(f"{what} called sys.exit({result.code!r}) instead of returning its rewards "
                                      "(argparse and click exit this way on bad arguments).") from result
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
    return results


def describe_failed_call(fn: Callable, name: str, error: Exception, prompts: list, completions: list,
                         columns: dict[str, Any], timeout: float | None) -> str:
    """What went wrong in a call of ``fn`` on the batch, as one line: a timeout names the limit and the knob; a
    raised error is located by calling ``fn`` again row by row (within ``timeout`` in all, as the batch call was)."""
    n = len(prompts)
    if isinstance(error, CallTimeout):
        return (f"Reward function '{name}' did not return within {timeout:g} s on a call of {n} completions. If it "
                f"is just slow, raise {TIMEOUT_KNOB} (null: no limit); to score a call that fails or hangs with a "
                "fixed value and keep training, set model.reward_fallback_value. (The call keeps running on a "
                "background thread: Python cannot stop it.)")
    row = _first_failing_row(fn, prompts, completions, columns, timeout)
    if row is None:
        return f"Reward function '{name}' raised {error!r} on the batch of {n} completions (each row alone succeeds)"
    i, row_error = row
    where = f"index {i} (prompt {short_repr(prompts[i])}, completion {short_repr(completions[i])})"
    if isinstance(row_error, CallTimeout):
        return (f"Reward function '{name}' raised {error!r} on the batch of {n} completions; calling it row by row "
                f"to find the failing one ran out of its {timeout:g} s ({TIMEOUT_KNOB}) at {where} (the rows before "
                "it succeed alone)")
    return f"Reward function '{name}' raised {type(row_error).__name__} at {where}: {row_error}"


def _first_failing_row(fn: Callable, prompts: list, completions: list, columns: dict[str, Any],
                       timeout: float | None) -> tuple[int, Exception] | None:
    """The first row on which ``fn`` alone raises, or where the search runs out of its ``timeout`` seconds
    (``CallTimeout``: that row had not returned, or the time was used up before it); None when every row alone
    succeeds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for i in range(len(prompts)):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return i, CallTimeout(f"row {i}: no time left")
        row = {k: v[i : i + 1] if isinstance(v, (list, tuple, torch.Tensor)) else v for k, v in columns.items()}
        call = _with_callers_torch_state(
            lambda i=i, row=row: _call(fn, prompts[i : i + 1], completions[i : i + 1], row))
        try:
            call_with_deadline(call, left, f"row {i}")
        except Exception as err:  # noqa: BLE001 - this only locates the failure
            return i, err
    return None
