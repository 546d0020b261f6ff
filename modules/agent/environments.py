"""Environments (TRL's ``environment_factory``): one stateful object per trajectory of a rollout.

A factory (an import path of a class or function, called with no arguments) builds an environment. Its contract is
TRL's: ``reset(**row)`` is called before the trajectory starts with the prompt's data row (``prompt`` and every
other column) and returns ``None`` or a string appended to the last user message; its public methods are the
tools of that trajectory (type hints and docstring give their schemas); ``get_reward()``, when defined, scores the
finished trajectory from the environment's state (a reward source named after the class, weight 1, beside
``reward_funcs``). lightalign adds ``close()``, called once the rollout is scored, and also when the run stops on
an error (``EpisodeEnvironments.close``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from lightalign.modules.agent.tools import tool_name, tool_schema
from lightalign.rewards.deadline import CallTimeout, map_with_deadline
from lightalign.rewards.resolve import import_object

LIFECYCLE_METHODS = ("reset", "get_reward", "close")


class EnvironmentCallError(RuntimeError):
    """An environment's factory or ``reset`` raised: the message names the class, the method and the rollout row."""


def _build(factory: Callable, spec: Any) -> Any:
    try:
        return factory()
    except Exception as err:
        raise EnvironmentCallError(f"environment_factory {spec!r} raised {type(err).__name__} building an "
                                   f"environment: {err}") from err


class EnvironmentFactory:
    """The checked factory: its environments' tool method names and whether they own a reward (probed on one
    instance, closed again, when the module is built)."""

    def __init__(self, spec: str | Callable) -> None:
        self.spec = spec
        self.factory = import_object(spec, "environment factory") if isinstance(spec, str) else spec
        if not callable(self.factory):
            raise ValueError(f"environment_factory {spec!r} resolved to a {type(self.factory).__name__}; give a "
                             "class or a function that returns an environment.")
        probe = _build(self.factory, spec)
        cls = type(probe)
        self.class_name = cls.__name__
        if not callable(getattr(probe, "reset", None)):
            raise ValueError(f"The environment {self.class_name} (environment_factory {spec!r}) has no reset(**row) "
                             "method; it is called before each trajectory with the prompt's data row.")
        # listed on the class: inspecting the instance would evaluate properties
        self.tool_names = [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
                           if not name.startswith("_") and name not in LIFECYCLE_METHODS]
        if not self.tool_names:
            raise ValueError(f"The environment {self.class_name} has no public method besides "
                             f"{list(LIFECYCLE_METHODS)}: its public methods are the policy's tools.")
        self.schemas = [tool_schema(getattr(probe, name), f"tool of {self.class_name}") for name in self.tool_names]
        self.owns_reward = callable(getattr(probe, "get_reward", None))
        close_environment(probe)

    def tools_of(self, environment: Any, extra: Sequence[Callable]) -> dict[str, Callable]:
        """The tools one trajectory may call: its environment's methods and the plain ``tools`` (names checked
        unique when the module is built)."""
        tools = {name: getattr(environment, name) for name in self.tool_names}
        return {**tools, **{tool_name(t): t for t in extra}}

    def build(self, count: int) -> "EpisodeEnvironments":
        return EpisodeEnvironments([_build(self.factory, self.spec) for _ in range(count)])


class EpisodeEnvironments:
    """The environments of one rollout, one per trajectory, closed exactly once."""

    def __init__(self, environments: list[Any]) -> None:
        self.environments = environments
        self.closed = False

    def reset(self, rows: list[dict[str, Any]]) -> list[str | None]:
        observations = []
        for i, (env, row) in enumerate(zip(self.environments, rows)):
            try:
                out = env.reset(**row)
            except Exception as err:
                raise EnvironmentCallError(f"{type(env).__name__}.reset raised {type(err).__name__} on rollout row {i} "
                                           f"(data columns {sorted(row)}): {err}") from err
            if out is not None and not isinstance(out, str):
                raise TypeError(f"{type(env).__name__}.reset returned a {type(out).__name__} for rollout row {i}; "
                                "it returns None or a string appended to the last user message.")
            observations.append(out)
        return observations

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        errors = []
        for env in self.environments:
            try:
                close_environment(env)
            except Exception as err:  # noqa: BLE001 - every environment gets its close; the first error is raised
                errors.append(err)
        if errors:
            raise errors[0]


@contextlib.contextmanager
def closing_environments(rollout: dict[str, Any]):
    """Close a rollout's environments when the block ends (they are scored inside it), also on an error."""
    try:
        yield
    finally:
        envs = rollout.get("environments")
        if envs is not None:
            envs.close()


def close_environment(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        close()


class EnvironmentReward:
    """The reward of environments that own it: ``get_reward()`` of each trajectory's environment, all at once
    (one thread each), within ``timeout`` seconds. A TRL-style reward function (``environments`` is the column the
    rollout passes), named after the environment class."""

    def __init__(self, class_name: str, timeout: float | None = None) -> None:
        self.__name__ = class_name
        self.timeout = timeout

    def __call__(self, prompts: list, completions: list, environments: list[Any] | None = None,
                 **columns: Any) -> list[float | None]:
        if environments is None:
            raise ValueError(f"{self.__name__} reward needs the rollout's environments (the 'environments' column).")
        whats = [f"{self.__name__}.get_reward() of rollout row {i}" for i in range(len(environments))]
        values = map_with_deadline([env.get_reward for env in environments], self.timeout, whats, return_errors=True)
        out: list[float | None] = []
        for i, value in enumerate(values):
            if isinstance(value, CallTimeout):
                raise CallTimeout(f"{value} (raise model.reward_timeout if it needs longer)")
            if isinstance(value, BaseException):
                raise RuntimeError(f"{self.__name__}.get_reward() raised {type(value).__name__} on rollout row {i}: "
                                   f"{value}") from value
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"{self.__name__}.get_reward() returned {value!r} on rollout row {i}; it returns a "
                                 "finite number (or None when it does not apply).")
            out.append(value)
        return out
