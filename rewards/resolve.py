"""Turning reward specs into reward functions: import paths, classes, reward model folders; their metric names.

YAML names reward functions by import path (``lightalign.rewards.accuracy_reward``, ``my_module:my_reward``), by
``{class_path, init_args}``, or by a reward model folder / hub name.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lightalign.rewards.model import RewardModel

__all__ = [
    "check_reward_weights",
    "import_object",
    "resolve_reward_funcs",
    "reward_func_name",
    "reward_func_names",
]


class RewardImportError(ImportError):
    """A reward function named by an import path that does not lead to one (the user's input: the message says
    where it looked). An error raised while importing a module that exists stays an ImportError with its
    traceback: that is a bug inside that module."""


def _import_attr(module_name: str, attr: str) -> Any:
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _try_import(path: str, tried: list[str]) -> Any:
    if ":" in path:
        splits = [tuple(path.split(":", 1))]
    elif "." not in path:  # a bare name: one of the built-ins
        splits = [("lightalign.rewards", path)]
    else:
        parts = path.split(".")
        splits = [(".".join(parts[:i]), ".".join(parts[i:])) for i in range(len(parts) - 1, 0, -1)]
    for module_name, attr in splits:
        try:
            return _import_attr(module_name, attr)
        except ModuleNotFoundError as err:
            if err.name is None or not (module_name == err.name or module_name.startswith(err.name + ".")):
                raise ImportError(f"Importing '{module_name}' for reward '{path}' failed: {err}") from err
            tried.append(f"module '{module_name}' (not found)")
        except AttributeError as err:
            tried.append(f"'{attr}' in module '{module_name}' ({err})")
    raise LookupError


def import_object(path: str, what: str = "reward function") -> Any:
    """Import ``"pkg.mod.name"`` or ``"pkg.mod:name"``; a bare name is a built-in of ``lightalign.rewards``.
    ``what`` names the object in the error (a reward function, a tool, an environment factory).

    When the module is not found, the current directory is tried too (``examples.rewards.my_fn`` from the repo).
    """
    tried: list[str] = []
    try:
        return _try_import(path, tried)
    except LookupError:
        pass
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # user modules next to the config, as `python -m` would find them
        tried = []  # what the second attempt found supersedes the first's "not found"
        try:
            return _try_import(path, tried)
        except LookupError:
            tried.append(f"with the current directory {cwd} on sys.path")
    raise RewardImportError(
        f"Cannot import {what} '{path}'. Tried: " + "; ".join(dict.fromkeys(tried)) + ". Give an import path like "
        "'mypkg.module.name' or 'my_module:name', importable from here."
    )


def _check_callable(obj: Any, spec: Any) -> Callable:
    if isinstance(obj, torch.nn.Module):
        raise TypeError(f"Reward {spec!r} is a torch module; pass its folder or hub name, or a RewardModel.")
    if isinstance(obj, type):  # a class named by path: build it with its defaults
        try:
            obj = obj()
        except TypeError as err:
            raise TypeError(
                f"Reward {spec!r} is a class that needs arguments ({err}); in YAML use "
                f"{{class_path: {spec}, init_args: {{...}}}}."
            ) from err
    if not callable(obj):
        raise TypeError(f"Reward {spec!r} resolved to a {type(obj).__name__}, which is not callable.")
    return obj


def _resolve_one(spec: Any) -> Callable:
    if isinstance(spec, dict) and "class_path" in spec:
        cls = import_object(spec["class_path"])
        return _check_callable(cls(**(spec.get("init_args") or {})), spec["class_path"])
    if not isinstance(spec, str):
        return _check_callable(spec, spec)
    name = spec.strip()
    if not name:
        raise ValueError("A reward function spec is an empty string.")
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return RewardModel(name).check()
        raise ValueError(f"Reward '{spec}' is a folder without config.json; a reward model folder needs one.")
    if path.is_file() or (name.startswith((".", "/", "~")) and not path.exists()):
        raise ValueError(f"Reward '{spec}' looks like a path, but there is no model folder at '{path.resolve()}'.")
    if "/" in name:  # "org/model": a hub reward model (import paths use '.' or ':')
        return RewardModel(name).check()
    return _check_callable(import_object(name), spec)


def resolve_reward_funcs(specs: Any) -> list[Callable]:
    """Turn specs into reward functions. A spec is a callable, an import path (``"pkg.mod.fn"`` or
    ``"pkg.mod:fn"``; a class is built with its defaults), ``{"class_path": ..., "init_args": {...}}``, or a
    reward model: a local folder with config.json or a hub name ``"org/name"`` (a lazily loaded ``RewardModel``).
    """
    if specs is None:
        return []
    if isinstance(specs, (str, dict)) or callable(specs):
        specs = [specs]
    return [_resolve_one(spec) for spec in specs]


def reward_func_name(fn: Callable) -> str:
    """The metric name of a reward function: its ``__name__`` (also on instances), else its class name."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


def reward_func_names(funcs: Sequence[Callable]) -> list[str]:
    """Names of all functions, made unique: a repeated name gets ``_1``, ``_2``, ... on its later uses."""
    names: list[str] = []
    for fn in funcs:
        base = name = reward_func_name(fn)
        k = 0
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.append(name)
    return names


def check_reward_weights(funcs: Sequence[Callable], weights: Sequence[float] | None) -> torch.Tensor:
    """The weights as a float32 tensor (ones when None); one finite weight per reward function."""
    if weights is None:
        return torch.ones(len(funcs), dtype=torch.float32)
    weights = [float(w) for w in (weights.tolist() if isinstance(weights, torch.Tensor) else weights)]
    if len(weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(weights)} values but there are {len(funcs)} reward functions "
            f"({reward_func_names(funcs)}); give one weight per function."
        )
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"reward_weights must be finite numbers, got {weights}.")
    return torch.tensor(weights, dtype=torch.float32)
