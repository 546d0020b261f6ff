"""What the chat template defines about a turn: how an assistant turn's tool calls are read back (the tokenizer's
``response_template``, transformers' ``parse_response``) and which token ids follow it when tool results come back
(the template's tool turns and the next generation prompt).

The tool-result ids are the difference between the template's rendering of a short conversation ending in an
assistant tool call and the same conversation with the tool messages and the generation prompt after it, cut at
the assistant turn's end-of-turn token (TRL derives them the same way). They are appended to the ids the policy
sampled; the sampled ids are never decoded and re-tokenised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any



class ToolCallFormatError(ValueError):
    """The tokenizer cannot parse tool calls or render tool results."""


def check_tool_template(tokenizer: Any, where: str) -> None:
    """Refuse a tokenizer without a chat template: the tool list and tool results could not be rendered. (Which
    ``response_template`` reads the calls back is chosen and proven by ``choose_response_template``.)"""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if not getattr(tokenizer, "chat_template", None):
        raise ToolCallFormatError(f"{where}: the tokenizer {name!r} has no chat template, so the tool list and tool "
                                  "results cannot be rendered; set data.chat_template or use an instruct tokenizer.")


def parse_turn(tokenizer: Any, turn_ids: Sequence[int], prefix_ids: Sequence[int],
               tools: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """The assistant message one turn's ids hold (``content``, ``tool_calls``), and the parser's complaint when the
    turn is malformed (then the message is ``{}``: the turn's text stays as sampled, the policy is told)."""
    try:
        message = tokenizer.parse_response(list(turn_ids), prefix=list(prefix_ids), tools=tools)
    except ValueError as err:  # transformers' parser reports a malformed region as a ValueError
        return {}, str(err).splitlines()[0]
    return message, None


def tool_result_ids(tokenizer: Any, tool_messages: list[dict[str, Any]], eos: Sequence[int],
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The ids that follow an assistant turn ending in tool calls: the ``tool`` messages as the template renders
    them, then the next assistant generation prompt."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    kwargs = dict(tokenize=True, return_dict=False, **(chat_template_kwargs or {}))
    prefix = list(tokenizer.apply_chat_template(head, add_generation_prompt=False, **kwargs))
    full = list(tokenizer.apply_chat_template(head + tool_messages, add_generation_prompt=True, **kwargs))
    ends = [i for i, t in enumerate(prefix) if t in set(eos)]
    if not ends:
        raise ToolCallFormatError("The chat template's assistant turn has no end-of-turn token among the model's EOS "
                                  f"ids {list(eos)}: the tool results cannot be placed after a sampled turn.")
    prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ToolCallFormatError("The chat template renders the assistant turn differently once tool messages "
                                  "follow it, so tool results cannot be appended to the sampled ids exactly.")
    return full[len(prefix):]
