"""Running reward functions the way TRL's GRPOTrainer does: call them, check what they return, sum them.

Each function is called as ``fn(prompts=..., completions=..., **columns)``; ``None`` in its output becomes NaN, and
the total reward of a completion is the weighted ``nansum`` over functions. A completion every function returned
None for has a NaN total (TRL: it is left out of the group baseline and gets advantage 0, see ``advantages.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightalign.rewards.resolve import check_reward_weights, reward_func_names

__all__ = ["RewardFunctionError", "compute_rewards"]


class RewardFunctionError(RuntimeError):
    """A reward function failed or returned something unusable; the message names the function and the row."""


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_per_row(value: Any) -> bool:
    return isinstance(value, (list, tuple, torch.Tensor))


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


def _first_failing_row(fn: Callable, prompts: list, completions: list, columns: dict[str, Any]):
    for i in range(len(prompts)):
        row = {k: v[i : i + 1] if _is_per_row(v) else v for k, v in columns.items()}
        try:
            _call(fn, prompts[i : i + 1], completions[i : i + 1], row)
        except Exception as err:  # noqa: BLE001 - we only locate the failure here
            return i, err
    return None, None


def _check_signature(fn: Callable, name: str, columns: dict[str, Any]) -> None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    given = {"prompts", "completions", *columns}
    missing = [p.name for p in params if p.kind in kinds and p.default is p.empty and p.name not in given]
    if missing:
        raise RewardFunctionError(
            f"Reward function '{name}' needs {missing}, but the batch only provides {sorted(given)}. "
            "Add the column to the dataset (extra columns reach reward functions by name) or give it a default."
        )


def _as_floats(out: Any, name: str, n: int) -> list[float]:
    if isinstance(out, torch.Tensor) or type(out).__module__ == "numpy":
        out = out.tolist() if getattr(out, "ndim", 1) else out
    elif hasattr(out, "__next__"):  # a generator or iterator
        out = list(out)
    if not isinstance(out, Sequence) or isinstance(out, (str, bytes)):
        raise RewardFunctionError(
            f"Reward function '{name}' returned a {type(out).__name__}; expected a list of {n} floats (or None)."
        )
    if len(out) != n:
        raise RewardFunctionError(
            f"Reward function '{name}' returned {len(out)} values; expected {n}, one per completion."
        )
    values = []
    for i, v in enumerate(out):
        if v is None:
            values.append(math.nan)
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if not isinstance(v, numbers.Real):
            raise RewardFunctionError(
                f"Reward function '{name}' returned the non-numeric value {_short(v)} at index {i}."
            )
        if not math.isfinite(v):
            raise RewardFunctionError(
                f"Reward function '{name}' returned {v} at index {i}; rewards must be finite "
                "(return None for a row the function does not apply to)."
            )
        values.append(float(v))
    return values


def compute_rewards(
    funcs: Sequence[Callable],
    prompts: list,
    completions: list,
    columns: dict[str, Any] | None = None,
    weights: Sequence[float] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every reward function on the batch; return ``(per_function [N, F], total [N])`` as float32.

    ``columns`` are passed as keyword arguments: lists (one value per completion) and anything else (e.g. a
    trainer state) as is. ``per_function`` holds NaN where a function returned None; ``total`` is the weighted
    nansum, NaN for a completion every function returned None for (with a warning naming the first such row).
    """
    if not funcs:
        raise ValueError("compute_rewards needs at least one reward function.")
    n, columns = len(prompts), dict(columns or {})
    if len(completions) != n:
        raise ValueError(f"Got {n} prompts but {len(completions)} completions; pass one prompt per completion.")
    for key, value in columns.items():
        if isinstance(value, (list, tuple)) and len(value) != n:
            raise ValueError(f"Column '{key}' has {len(value)} values for {n} completions; repeat it per completion.")
    w = check_reward_weights(funcs, weights)
    per_func = torch.full((n, len(funcs)), math.nan, dtype=torch.float32)
    for j, (fn, name) in enumerate(zip(funcs, reward_func_names(funcs))):
        _check_signature(fn, name, columns)
        try:
            out = _call(fn, prompts, completions, columns)
        except Exception as err:
            i, row_err = _first_failing_row(fn, prompts, completions, columns)
            if i is None:
                what = f"{err!r} on the batch of {n} completions (each row alone succeeds)"
            else:
                what = f"{type(row_err).__name__} at index {i} (prompt {_short(prompts[i])}, completion "
                what += f"{_short(completions[i])}): {row_err}"
            raise RewardFunctionError(f"Reward function '{name}' raised {what}") from err
        per_func[:, j] = torch.tensor(_as_floats(out, name, n), dtype=torch.float32)
    unscorable = torch.isnan(per_func).all(dim=1)
    total = (per_func * w.unsqueeze(0)).nansum(dim=1)
    total[unscorable] = math.nan
    if unscorable.any():
        i = int(unscorable.nonzero()[0, 0])
        warnings.warn(
            f"All reward functions returned None for {int(unscorable.sum())} of {n} completions, first at index {i} "
            f"(prompt {_short(prompts[i])}). Such completions get no reward and advantage 0; make sure at least one "
            "reward function returns a value for every row.",
            RuntimeWarning,
            stacklevel=2,
        )
    return per_func, total
