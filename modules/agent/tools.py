"""Tools the policy may call during a rollout: plain Python functions (TRL's ``tools=``), named in YAML by import path.

A tool's JSON schema comes from its type hints and docstring (transformers' ``get_json_schema``, the schema the
chat template renders), so a function without them is refused when the module is built. A call never crashes the
run: an unknown tool, wrong arguments, an exception or a call that outlives ``tool_timeout`` becomes the text of
the ``tool`` message the policy reads next (``ToolCall.content`` starts with ``error:``) and is counted as a failure.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightalign.rewards.calling import short_repr
from lightalign.rewards.deadline import CallTimeout, call_with_deadline
from lightalign.rewards.resolve import import_object


def tool_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def tool_schema(fn: Callable, owner: str = "tool") -> dict[str, Any]:
    """The JSON schema the chat template renders for ``fn`` (``get_json_schema``), or a ValueError saying what the
    function lacks."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # transformers raises several types; each is a user error in the tool's definition
        raise ValueError(f"The {owner} {tool_name(fn)!r} cannot be described to the model: {err}. A tool needs a "
                         "type hint on every argument and a Google-style docstring with an 'Args:' entry for each "
                         "(transformers.utils.get_json_schema reads them).") from err


def resolve_tools(specs: Sequence[str | Callable] | str | Callable | None) -> list[Callable]:
    """Tools from import paths (``mypkg.tools.calculate`` or ``mypkg.tools:calculate``) or callables, each with a
    schema; names must be unique."""
    if specs is None:
        return []
    if isinstance(specs, str) or callable(specs):
        specs = [specs]
    tools = []
    for spec in specs:
        fn = import_object(spec, "tool") if isinstance(spec, str) else spec
        if not callable(fn) or isinstance(fn, type):
            raise ValueError(f"Tool {spec!r} resolved to a {type(fn).__name__}; a tool is a function (type hints "
                             "and a docstring give its schema).")
        tool_schema(fn)
        tools.append(fn)
    check_unique_names([tool_name(t) for t in tools], "tools")
    return tools


def check_unique_names(names: Sequence[str], where: str) -> None:
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"Two tools are named {twice[0]!r} in {where}: the policy calls a tool by name, so names "
                         "must be unique.")


@dataclass
class ToolCall:
    """One executed call: the tool's name as the policy wrote it, the ``tool`` message's text, whether it failed."""

    name: str
    content: str
    failed: bool

    def message(self) -> dict[str, Any]:
        return {"role": "tool", "name": self.name, "content": self.content}


def run_tool_call(call: Any, tools: dict[str, Callable], timeout: float | None) -> ToolCall:
    """Execute one parsed call (``{"type": "function", "function": {"name", "arguments"}}``) among ``tools``.
    Never raises: every failure is the ``tool`` message's text."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return ToolCall("unknown", f"error: the tool call {short_repr(call)} has no function name; call a tool as "
                                   "the system prompt shows.", True)
    name, arguments = function["name"], function.get("arguments", {})
    if name not in tools:
        return ToolCall(name, f"error: there is no tool {name!r}; the tools are {sorted(tools)}.", True)
    if not isinstance(arguments, dict):
        return ToolCall(name, f"error: the arguments of {name} must be a JSON object, got {short_repr(arguments)}.",
                        True)
    fn = tools[name]
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as err:
        return ToolCall(name, f"error: wrong arguments for {name}: {err}.", True)
    except ValueError:  # a builtin without a signature: let the call say it
        pass
    try:
        result = call_with_deadline(lambda: fn(**arguments), timeout, f"tool {name!r}")
    except CallTimeout as err:
        return ToolCall(name, f"error: {err}.", True)
    except SystemExit as err:  # argparse or click inside the tool: the run goes on
        return ToolCall(name, f"error: {name} exited (sys.exit({err.code!r})) instead of returning a result.", True)
    except Exception as err:  # noqa: BLE001 - the policy reads what went wrong, the run goes on
        return ToolCall(name, f"error: {type(err).__name__}: {err}", True)
    return ToolCall(name, _as_text(result), False)


def _as_text(result: Any) -> str:
    """A tool's result as the ``tool`` message's text: strings as they are, JSON for what JSON can hold."""
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list, tuple, int, float, bool)) or result is None:
        try:
            return json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError):
            pass
    return str(result)
