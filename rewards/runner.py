"""Running reward functions the way TRL's GRPOTrainer does: call them, check what they return, sum them.

Each function is called once on the batch as ``fn(prompts=..., completions=..., **columns)``, all functions at once,
each within ``reward_timeout`` seconds (``call_reward_functions``). ``None`` in its output becomes NaN, and the total
reward of a completion is the weighted ``nansum`` over functions. A completion every function returned None for has a
NaN total (TRL: it is left out of the group baseline and gets advantage 0, see ``scale_advantages``); a rollout where
that holds for every completion is an error (training on it would learn nothing).

With ``reward_fallback_value`` set, a call that raises or does not return in time scores each of its rows with that
value, and so does each NaN or infinite value a function returns; every substitution is counted per function. A
result of the wrong length or a non-numeric value stays an error: that is a bug in the function, which a fallback
would hide for the whole run.
"""

from __future__ import annotations

import dataclasses

import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from lightalign.rewards.calling import (CallTimeout, RewardFunctionError, call_reward_functions, describe_failed_call,
                                        short_repr)
from lightalign.knobs import KnobGroup, knob
from lightalign.rewards.resolve import check_reward_weights, resolve_reward_funcs, reward_func_names

__all__ = ["FallbackReport", "RewardFunctionError", "RewardScores", "check_reward_call_knobs", "compute_rewards"]


@dataclass(frozen=True)
class FallbackReport:
    """How often one function's rewards were replaced by ``reward_fallback_value`` in one call, and why (the first
    cause, at row ``first_row``)."""

    count: int
    first_row: int
    cause: str


class RewardScores(NamedTuple):
    """What ``compute_rewards`` returns: each function's rewards ``[N, F]`` (NaN where it returned None), their
    weighted sum ``[N]`` (NaN where no function scored the row), and the fallback substitutions by function name
    (only the functions that had any)."""

    per_func: torch.Tensor
    total: torch.Tensor
    fallbacks: dict[str, FallbackReport]


@dataclasses.dataclass(frozen=True)
class RewardKnobs(KnobGroup):
    """The reward functions of an online method and how each call is run."""

    group = "rewards"
    reward_funcs: list[str | Callable] | str | Callable | None = knob(
        None, "reward functions ``fn(prompts, completions, **columns) -> list[float | None]``: callables, import paths "
              "(``lightalign.rewards.accuracy_reward``, ``mypkg.rewards:fn``) or reward-model folders (``RewardModule`` "
              "exports). ``None`` marks a completion a function cannot score.", saved=False)
    reward_weights: list[float] | None = knob(None, "one weight per reward function (default 1 each); the reward is "
                                                    "their weighted sum.")
    reward_timeout: float | None = knob(
        300.0, "seconds each reward function call may take (the functions of a rollout are called at once, each once "
               "on the whole batch, on threads); a call that has not returned by then stops training with an error "
               "naming the function, or scores with ``reward_fallback_value``. None: no limit.")
    reward_fallback_value: float | None = knob(
        None, "the reward of every row of a call that raised or timed out, and of each NaN or infinite value a "
              "function returns (None still means \"not applicable\"). Each substitution is counted in "
              "``reward/<function>/fallbacks`` and the first per function is warned about. None: such a call stops "
              "training with an error naming the function (and the failing row, or the limit). A result of the wrong "
              "length or a non-numeric value is always an error.")

    def check(self) -> None:
        check_reward_call_knobs(self.reward_timeout, self.reward_fallback_value)

    def resolved(self) -> list[Callable]:
        """The reward functions, imported or loaded, their weights checked against them."""
        given = [] if self.reward_funcs is None else self.reward_funcs
        funcs = resolve_reward_funcs(list(given if isinstance(given, (list, tuple)) else [given]))
        check_reward_weights(funcs, self.reward_weights)
        return funcs

def check_reward_call_knobs(reward_timeout: float | None, reward_fallback_value: float | None) -> None:
    """Refuse a time limit that is not a positive number of seconds, and a fallback that is not a finite number."""
    if reward_timeout is not None and not (isinstance(reward_timeout, numbers.Real) and 0 < reward_timeout < math.inf):
        raise ValueError(f"reward_timeout must be a positive number of seconds (each reward function call's limit) or "
                         f"null (no limit), got {reward_timeout!r}.")
    if reward_fallback_value is not None and not (isinstance(reward_fallback_value, numbers.Real)
                                                  and math.isfinite(reward_fallback_value)):
        raise ValueError(f"reward_fallback_value must be a finite number (the reward of a row whose function call "
                         f"failed) or null (a failing call stops training), got {reward_fallback_value!r}.")


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


def _as_floats(out: Any, name: str, n: int) -> list[float | None]:
    """The function's output as ``n`` floats or None; NaN or infinite values are kept as they are."""
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
            values.append(None)
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if not isinstance(v, numbers.Real):
            raise RewardFunctionError(
                f"Reward function '{name}' returned the non-numeric value {short_repr(v)} at index {i}."
            )
        values.append(float(v))
    return values


def _substitute_non_finite(values: list[float | None], name: str, fallback: float | None) -> FallbackReport | None:
    """Replace each NaN or infinite value (not a None) by ``fallback`` in place; without a fallback such a value is
    an error naming the function and the index."""
    bad = [i for i, v in enumerate(values) if v is not None and not math.isfinite(v)]
    if not bad:
        return None
    i = bad[0]
    if fallback is None:
        raise RewardFunctionError(
            f"Reward function '{name}' returned {values[i]} at index {i}; rewards must be finite (return None for a "
            "row the function does not apply to, or set model.reward_fallback_value to score such a row with it)."
        )
    cause = f"returned {values[i]} at index {i}"
    for j in bad:
        values[j] = fallback
    return FallbackReport(count=len(bad), first_row=i, cause=cause)


def compute_rewards(
    funcs: Sequence[Callable],
    prompts: list,
    completions: list,
    columns: dict[str, Any] | None = None,
    weights: Sequence[float] | torch.Tensor | None = None,
    *,
    reward_timeout: float | None = None,
    reward_fallback_value: float | None = None,
) -> RewardScores:
    """Run every reward function on the batch (all at once, each within ``reward_timeout`` seconds; None: no limit);
    return ``RewardScores(per_func [N, F], total [N], fallbacks)``, the tensors float32.

    ``columns`` are passed as keyword arguments: lists (one value per completion) and anything else (e.g. a
    trainer state) as is. ``per_func`` holds NaN where a function returned None; ``total`` is the weighted
    nansum, NaN for a completion every function returned None for (with a warning naming the first such row; an
    error when that is every completion). A call that raises or times out is an error naming the function (and the
    first row that fails alone, or the limit), unless ``reward_fallback_value`` is set: then each of its rows, and
    each NaN or infinite value, gets that value and is counted in ``fallbacks``.
    """
    if not funcs:
        raise ValueError("compute_rewards needs at least one reward function.")
    check_reward_call_knobs(reward_timeout, reward_fallback_value)
    n, columns = len(prompts), dict(columns or {})
    if len(completions) != n:
        raise ValueError(f"Got {n} prompts but {len(completions)} completions; pass one prompt per completion.")
    for key, value in columns.items():
        if isinstance(value, (list, tuple)) and len(value) != n:
            raise ValueError(f"Column '{key}' has {len(value)} values for {n} completions; repeat it per completion.")
    w = check_reward_weights(funcs, weights)
    names = reward_func_names(funcs)
    for fn, name in zip(funcs, names):
        _check_signature(fn, name, columns)
    outputs = call_reward_functions(funcs, names, prompts, completions, columns, reward_timeout)
    per_func = torch.full((n, len(funcs)), math.nan, dtype=torch.float32)
    fallbacks: dict[str, FallbackReport] = {}
    for j, (fn, name, out) in enumerate(zip(funcs, names, outputs)):
        if isinstance(out, Exception):
            if reward_fallback_value is None:
                message = describe_failed_call(fn, name, out, prompts, completions, columns, reward_timeout)
                raise RewardFunctionError(message) from out
            per_func[:, j] = reward_fallback_value
            fallbacks[name] = FallbackReport(count=n, first_row=0, cause=_failed_call_cause(out, n, reward_timeout))
            continue
        values = _as_floats(out, name, n)
        report = _substitute_non_finite(values, name, reward_fallback_value)
        if report is not None:
            fallbacks[name] = report
        per_func[:, j] = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)
    unscorable = torch.isnan(per_func).all(dim=1)
    total = (per_func * w.unsqueeze(0)).nansum(dim=1)
    total[unscorable] = math.nan
    if n and unscorable.all():
        raise RewardFunctionError(
            f"No completion of the rollout has a reward: reward function(s) {names} returned None for all {n} "
            f"completions (the first: prompt {short_repr(prompts[0])}, completion {short_repr(completions[0])}), so "
            "training on it would learn nothing. Check that each function gets what it needs (the dataset columns "
            f"it reads reach it by name; this batch has {sorted(columns)}) and that it returns a number for the "
            "completions it applies to."
        )
    if unscorable.any():
        i = int(unscorable.nonzero()[0, 0])
        warnings.warn(
            f"All reward functions returned None for {int(unscorable.sum())} of {n} completions, first at index {i} "
            f"(prompt {short_repr(prompts[i])}). Such completions get no reward and advantage 0; make sure at least "
            "one reward function returns a value for every row.",
            RuntimeWarning,
            stacklevel=2,
        )
    return RewardScores(per_func, total, fallbacks)


def _failed_call_cause(error: Exception, n: int, timeout: float | None) -> str:
    if isinstance(error, CallTimeout):
        return f"did not return within {timeout:g} s on a call of {n} completions"
    return f"raised {short_repr(error, 200)} on a call of {n} completions"
