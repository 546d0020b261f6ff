"""Which ``response_template`` reads the policy's tool calls back, and the proof that it reads them.

A tool rollout parses each assistant turn with transformers' ``tokenizer.parse_response`` and the tokenizer's
``response_template`` (a dict: where an assistant turn starts, which regions hold text and which hold calls). A
template that does not match the chat template's call syntax parses every call as plain text: no tool ever runs and
GRPO silently trains without tools (``tools/call_frequency`` 0). So at fit start:

1. the template is chosen (``choose_response_template``): ``model.response_template`` when given, else the
   tokenizer's own (``tokenizer_config.json``), else a shipped one for the chat template's family, recognised by the
   call syntax the chat template writes (``FAMILIES``: Qwen/Hermes ``<tool_call>``, Llama 3.x JSON with
   ``"parameters"``, Mistral ``[TOOL_CALLS]``); a chat template of no known family is refused, saying how to give one;
2. it is proven (``check_round_trip``): a known call is rendered by the model's own chat template, and the chosen
   template must parse exactly that call (name and arguments) back out of the rendered turn; otherwise the run is
   refused, naming where the template came from and what it parsed instead.

The shipped templates follow the chat templates' real call syntax; the round trip, not the recognition, is what
makes a template trusted, so a recognised family whose template differs in detail is refused too, not guessed at.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lightalign.modules.agent.turns import ToolCallFormatError

KNOB = "model.response_template"

# Qwen 2.5/3, Hermes, the shipped tiny model: ChatML turns, each call ``<tool_call>{"name", "arguments"}</tool_call>``.
HERMES_TOOL_CALL = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

# Llama 3.1/3.2/3.3: after the assistant header the turn is either text or one ``{"name": ..., "parameters": {...}}``
# object, ended by ``<|eot_id|>`` (``<|eom_id|>`` after a built-in tool's call).
LLAMA3_JSON = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {"open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
                       "close_pattern": r"\}\s*<\|(?:eot|eom)_id\|>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}},
        "content": {"close_pattern": r"<\|(?:eot|eom)_id\|>\s*", "content": "text"},
    },
}

# Mistral (v0.3 tokenizers, Mistral-Nemo, Small): ``[TOOL_CALLS] [{"name", "arguments", "id"?}, ...]</s>`` after
# ``[/INST]`` or after the last ``[/TOOL_RESULTS]``.
MISTRAL_TOOL_CALLS = {
    "defaults": {"role": "assistant"},
    "start_anchor": ["[/INST]", "[/TOOL_RESULTS]"],
    "fields": {
        "tool_calls": {"open_pattern": r"\s*\[TOOL_CALLS\]\s*", "close_pattern": r"</s>\s*", "content": "json",
                       "transform_each": True,
                       "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}}},
        "content": {"close_pattern": r"</s>\s*", "content": "text"},
    },
}


@dataclass(frozen=True)
class Family:
    """A chat-template family: ``markers`` are strings its chat template holds when it writes calls that way (all of
    them), ``template`` the response template that reads them."""

    name: str
    markers: tuple[str, ...]
    template: dict[str, Any]

    def recognises(self, chat_template: str) -> bool:
        return all(m in chat_template for m in self.markers)


FAMILIES = (
    Family("Mistral [TOOL_CALLS]", ("[TOOL_CALLS]",), MISTRAL_TOOL_CALLS),
    Family("Llama 3.x JSON", ("<|start_header_id|>", '"parameters"'), LLAMA3_JSON),
    Family("Qwen/Hermes <tool_call>", ("<|im_start|>", "<tool_call>"), HERMES_TOOL_CALL),
)


def recognise(chat_template: str) -> Family | None:
    """The family whose call syntax ``chat_template`` writes, or None."""
    for family in FAMILIES:
        if family.recognises(chat_template):
            return family
    return None


def choose_response_template(tokenizer: Any, given: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    """The response template tool rollouts parse turns with, and how it was chosen (for the fit-start line):
    ``given`` (``model.response_template``) first, then the tokenizer's own, then the recognised family's."""
    if given is not None:
        return given, f"given by {KNOB}"
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return own, "the tokenizer's own (tokenizer_config.json)"
    chat_template = _chat_template_text(tokenizer)
    family = recognise(chat_template)
    if family is None:
        known = "; ".join(f"{f.name} (its chat template holds {' and '.join(map(repr, f.markers))})" for f in FAMILIES)
        raise ToolCallFormatError(
            f"tools: the chat template of {_name(tokenizer)!r} writes tool calls in a format lightalign does not "
            f"recognise, and neither {KNOB} nor the tokenizer gives a response_template, so the policy's calls "
            f"cannot be read back. Recognised: {known}. Give {KNOB}: a dict in transformers' response template "
            "format (keys start_anchor, fields: a 'tool_calls' field with open/close patterns and content 'json', a "
            "'content' field closed by the end-of-turn token; see lightalign.modules.agent.response_templates for "
            "three worked ones), or add response_template to the tokenizer's tokenizer_config.json.")
    return family.template, f"recognised as {family.name} from the chat template's call syntax"


# The call rendered and parsed back at fit start: a string, a number and a nested object, as real calls carry.
PROBE_CALL = {"name": "lookup", "arguments": {"city": "Paris", "days": 3, "options": {"unit": "celsius"}}}


def check_round_trip(tokenizer: Any, template: dict[str, Any], how: str,
                     chat_template_kwargs: dict[str, Any] | None = None) -> None:
    """Render ``PROBE_CALL`` as an assistant turn with the tokenizer's chat template and parse that turn back with
    ``template``; refuse unless exactly that call (name and arguments, nothing else) comes out."""
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = {"type": "function", "function": PROBE_CALL}
    kwargs = dict(tokenize=False, **(chat_template_kwargs or {}))
    try:
        prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, **kwargs)
        full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": [call]}],
                                             add_generation_prompt=False, **kwargs)
    except Exception as err:  # a template's own raise_exception, or a missing variable: say it is the template
        raise ToolCallFormatError(f"tools: the chat template of {_name(tokenizer)!r} cannot render an assistant "
                                  f"tool call ({type(err).__name__}: {err}), so tool rollouts cannot run.") from err
    if not full.startswith(prompt) or PROBE_CALL["name"] not in full[len(prompt):]:
        raise ToolCallFormatError(f"tools: the chat template of {_name(tokenizer)!r} does not render an assistant "
                                  "message's tool_calls after its generation prompt, so tool rollouts cannot run.")
    turn = full[len(prompt):]
    try:
        parsed = tokenizer.parse_response(turn, schema=template, prefix=prompt)
        error = None
    except Exception as err:  # noqa: BLE001 - a malformed template or a parse failure both mean: it does not read it
        parsed, error = None, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    calls = [(c.get("function") or {}) if isinstance(c, dict) else c for c in (parsed or {}).get("tool_calls") or []]
    if error is None and [(c.get("name"), c.get("arguments")) for c in calls if isinstance(c, dict)] == [
            (PROBE_CALL["name"], PROBE_CALL["arguments"])] and len(calls) == 1:
        return
    if error is not None:
        what = f"raised {error}"
    elif not calls:
        text = str((parsed or {}).get("content") or "")
        what = f"found no tool call in it (it read the turn as text ending {text[-80:]!r})"
    else:
        what = f"parsed the calls {_short(calls)}"
    raise ToolCallFormatError(
        f"tools: the response_template ({how}) does not read the tool calls the chat template of "
        f"{_name(tokenizer)!r} writes: the chat template renders the call {_short(PROBE_CALL)} as {turn!r}, and the "
        f"response_template {what}, not that call. Every policy call would be read as text (no tool would "
        f"run). Give {KNOB} matching this chat template's call syntax, or remove it to let lightalign recognise the "
        "chat template's family.")


def _chat_template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else str(template)


def _name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def _short(value: Any, limit: int = 300) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
