"""Dataset formats (TRL's): detecting, validating rows, applying chat templates (loading: ``load_rows``).

Formats, by the columns a row has:

* ``language_modeling``: ``text`` (or ``dataset_text_field``)
* ``prompt_completion``: ``prompt`` + ``completion`` (strings, or message lists = conversational)
* ``conversational``: ``messages`` (a list of ``{"role", "content"}``)
* ``preference``: ``prompt`` + ``chosen`` + ``rejected`` (explicit prompt) or ``chosen`` + ``rejected`` (implicit)
* ``prompt_only``: ``prompt`` (any other columns ride along, e.g. for reward functions)

Tool-calling conversations: an assistant message's ``tool_calls[].function.arguments`` is a JSON object, or a string
holding one (the OpenAI shape, common in TRL datasets); ``chat_messages`` parses the string form before any chat
template renders it, so both shapes give the same tokens. Every ``tool`` message answers a call of the assistant
message before it (``validate_messages``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:  # datasets (with pandas, pyarrow) is imported where rows are read, not for --help
    from datasets import Dataset

LANGUAGE_MODELING = "language_modeling"
PROMPT_COMPLETION = "prompt_completion"
CONVERSATIONAL = "conversational"
PREFERENCE = "preference"
PROMPT_ONLY = "prompt_only"

KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool")

FORMAT_HELP = (
    "language modeling ['text'], prompt-completion ['prompt', 'completion'], conversational ['messages'], "
    "preference ['prompt', 'chosen', 'rejected'] or ['chosen', 'rejected'], prompt-only ['prompt']"
)


class DataFormatError(ValueError):
    """A dataset, a split or a row that cannot be used; the message says which and why.

    Rows are numbered from 0 in the order of the user's data (``row 30`` is ``dataset[30]``, the 31st object of a
    JSON-lines file), whatever part of it (training or the carved-out validation rows) they end up in; errors
    found while reading a file name its line, counted from 1. ``row``: the row an error is about, when it is about
    one (the datamodule then adds the file's line, ``sources.row_line``).
    """

    row: int | None = None


@contextlib.contextmanager
def about_row(row: int):
    """Errors raised inside are about row ``row`` (``DataFormatError.row``, unless they already name one)."""
    try:
        yield
    except DataFormatError as err:
        if err.row is None:
            err.row = row
        raise


class MissingColumnError(DataFormatError):
    """A row without a column its data needs (``datasets`` reads a missing key as null, as an explicit null).
    ``row`` is its number in the user's data, so the datamodule can add the file's line (``sources.row_line``)."""

    def __init__(self, row: int, column: str, columns: Iterable[str], why: str) -> None:
        self.row = row
        super().__init__(f"row {row} has no column '{column}' (its columns: {', '.join(columns) or 'none'}): {why}")


# --------------------------------------------------------------------------------------------- detection
def is_conversation(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(isinstance(m, dict) and "role" in m for m in value)


def detect_format(dataset: Dataset, text_field: str = "text") -> str:
    """Name the TRL format of ``dataset`` from its columns; raise listing the columns found otherwise."""
    cols = set(dataset.column_names)
    if {"chosen", "rejected"} <= cols:
        return PREFERENCE
    if "messages" in cols:
        return CONVERSATIONAL
    if {"prompt", "completion"} <= cols:
        return PROMPT_COMPLETION
    if text_field in cols:
        return LANGUAGE_MODELING
    if "prompt" in cols:
        return PROMPT_ONLY
    raise DataFormatError(
        f"Unknown dataset format: found columns {sorted(cols)}; expected one of: {FORMAT_HELP}."
    )


def require_format(fmt: str, allowed: Iterable[str], what: str, columns: list[str]) -> None:
    allowed = tuple(allowed)
    if fmt not in allowed:
        raise DataFormatError(
            f"{what} cannot train on {fmt.replace('_', '-')} data (columns {sorted(columns)}); "
            f"it accepts: {', '.join(a.replace('_', '-') for a in allowed)}."
        )


# --------------------------------------------------------------------------------------------- validation
def validate_messages(messages: Any, row: int, column: str, require_assistant: bool = False,
                      follows: Sequence[dict] = ()) -> None:
    """Check one conversation; errors name the row, the column and the message index.

    ``follows``: the conversation this column continues (a completion's prompt, already checked), so that a ``tool``
    message at the start of a completion answers the prompt's last call (``_check_tool_answers``)."""
    with about_row(row):
        where = f"row {row}, column '{column}'"
        if not isinstance(messages, list) or not messages:
            raise DataFormatError(f"{where}: expected a non-empty list of messages, got {type(messages).__name__} {messages!r:.80}.")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                raise DataFormatError(f"{where}, message {i}: expected a dict with 'role' and 'content', got {msg!r:.80}.")
            role = msg.get("role")
            if role not in KNOWN_ROLES:
                raise DataFormatError(f"{where}, message {i}: unknown role {role!r}; known roles are {list(KNOWN_ROLES)}.")
            content = msg.get("content")
            if role == "assistant" and msg.get("tool_calls") is not None:
                _check_tool_calls(msg["tool_calls"], f"{where}, message {i} (assistant)")
            if role == "assistant" and msg.get("tool_calls") and (content is None or isinstance(content, str)):
                continue  # a tool-calling turn may have no text
            if isinstance(content, list) and content:  # content parts (TRL's multimodal messages)
                _check_content_parts(content, f"{where}, message {i} ({role})")
                continue
            if not isinstance(content, str):
                raise DataFormatError(
                    f"{where}, message {i} ({role}): content must be a string, got {type(content).__name__} {content!r:.80}."
                )
            if not content.strip():
                raise DataFormatError(f"{where}, message {i} ({role}): content is empty.")
        _check_tool_answers(messages, where, follows)
        if require_assistant and not any(m.get("role") == "assistant" for m in messages):
            raise DataFormatError(
                f"{where}: the conversation has no assistant turn, so assistant_only_loss leaves nothing to learn. "
                "Remove the row or set assistant_only_loss=False."
            )


def _check_content_parts(parts: list, where: str) -> None:
    """Content given as parts: each ``{"type": "image"}`` or ``{"type": "text", "text": <non-empty string>}``, at
    least one text or image (whether the images match the row's is ``vision.with_image_parts``' check)."""
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind == "image":
            continue
        raise DataFormatError(f"{where}, content part {j}: expected {{\"type\": \"text\", \"text\": ...}} or "
                              f"{{\"type\": \"image\"}}, got {part!r:.80}.")
    if not any(p["type"] == "image" or p["text"].strip() for p in parts):
        raise DataFormatError(f"{where}: content is empty.")


def validate_text(value: Any, row: int, column: str, expected: str = "a string") -> None:
    """``expected``: what the column may hold, for the message of a missing value."""
    with about_row(row):
        if value is None:  # (a JSONL row without the column reads as None, like an explicit null)
            raise DataFormatError(f"row {row}, column '{column}': missing or null; every row needs {expected} there.")
        if not isinstance(value, str):
            raise DataFormatError(f"row {row}, column '{column}': expected a string, got {type(value).__name__} {value!r:.80}.")
        if not value.strip():
            raise DataFormatError(f"row {row}, column '{column}': the text is empty.")


def validate_field(value: Any, row: int, column: str, require_assistant: bool = False, follows: Any = None) -> None:
    """A field is either plain text or a conversation (a list of messages). ``follows``: the field this one
    continues (a completion's ``prompt``), when it is a conversation (``validate_messages``)."""
    if isinstance(value, list):
        validate_messages(value, row, column, require_assistant=require_assistant,
                          follows=follows if isinstance(follows, list) else ())
    else:
        validate_text(value, row, column, expected="a string or a list of messages")


def iter_rows(dataset: Dataset, columns: list[str], numbers: Sequence[int] | None = None, batch_size: int = 1024):
    """Yield ``(row_number, row_dict)`` for the given columns, reading in batches.

    ``numbers``: each row's number in the user's data when ``dataset`` is a part of it (the validation carve-out);
    by default a row's number is its position.
    """
    index = 0
    for batch in dataset.select_columns(columns).iter(batch_size=batch_size):
        n = len(batch[columns[0]])
        for j in range(n):
            yield index if numbers is None else numbers[index], {c: batch[c][j] for c in columns}
            index += 1


# --------------------------------------------------------------------------------------------- tool calls
_CALL_SHAPE = '{"type": "function", "function": {"name": "...", "arguments": {...}}}'


def _function_of(call: Any) -> Any:
    """The part of a tool call holding ``name`` and ``arguments``: ``call["function"]`` (TRL's and OpenAI's shape),
    or the call itself (the flat shape, which chat templates read too: ``call['function'] if call['function'] is
    defined else call``)."""
    return call["function"] if isinstance(call, dict) and "function" in call else call


def _arguments_object(arguments: Any) -> tuple[dict | None, str]:
    """A call's ``arguments`` as a JSON object: (the object, "") for an object or a string holding one, else (None,
    why not)."""
    if isinstance(arguments, dict):
        return arguments, ""
    if not isinstance(arguments, str):
        return None, f"it is {_json_kind(arguments)}"
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as err:
        return None, f"the string is not valid JSON: {err.msg} at character {err.pos + 1}"
    if not isinstance(value, dict):
        return None, f"the string holds {_json_kind(value)}"
    return value, ""


def _json_kind(value: Any) -> str:
    """What JSON calls ``value`` (``json.loads``'s result), with its article."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _check_tool_calls(calls: Any, where: str) -> None:
    """An assistant message's ``tool_calls``: a list of calls whose ``arguments`` are a JSON object or a string
    holding one (``chat_messages`` parses that string before a template renders it: rendered as it is, the model
    would learn to write a quoted string where the template's calls hold an object). No ``arguments`` (null) is left
    to the template."""
    if not isinstance(calls, list):
        raise DataFormatError(f"{where}: 'tool_calls' must be a list of calls like {_CALL_SHAPE}, got "
                              f"{type(calls).__name__} {calls!r:.80}.")
    for j, call in enumerate(calls):
        function = _function_of(call)
        if not isinstance(function, dict):
            raise DataFormatError(f"{where}, tool call {j}: expected a call like {_CALL_SHAPE}, got {call!r:.80}.")
        arguments = function.get("arguments")
        if arguments is None:
            continue
        parsed, why = _arguments_object(arguments)
        if parsed is None:
            raise DataFormatError(
                f"{where}, tool call {j} ({function.get('name', '?')!r}): 'arguments' {arguments!r:.80} is not a JSON "
                f"object ({why}). Write them as an object of the call's parameters ({{\"city\": \"Paris\"}}) or as "
                "a string holding one ('{\"city\": \"Paris\"}')."
            )


def _check_tool_answers(messages: list[dict], where: str, follows: Sequence[dict] = ()) -> None:
    """Every ``tool`` message answers one call of the last assistant message before it (``follows`` + ``messages``
    is the conversation; ``follows`` was checked already): a tool message with no call to answer would train the
    model on a result nobody asked for, silently."""
    offset, last, calls, answers = len(follows), None, 0, 0
    for k, msg in enumerate([*follows, *messages]):
        role = msg.get("role")
        if role == "assistant":
            tool_calls = msg.get("tool_calls")
            last, calls, answers = k, len(tool_calls) if isinstance(tool_calls, list) else 0, 0
        elif role == "tool":
            answers += 1
            if answers <= calls:
                continue
            at = f"message {last - offset}" if last is not None and last >= offset else f"message {last} of the prompt"
            if last is None:
                found, fix = "no assistant message comes before it", "Add the assistant message that makes the call"
            elif not calls:
                found = f"the assistant message before it ({at}) made no tool call"
                fix = f"Give {at} the call in 'tool_calls' ({_CALL_SHAPE})"
            else:
                found = f"it is tool message {answers} after {at} (assistant), which made {calls} tool call(s)"
                fix = f"Give {at} one call per tool message in 'tool_calls'"
            raise DataFormatError(
                f"{where}, message {k - offset} (tool): a tool message answers a tool call of the assistant message "
                f"before it, but {found}. {fix}, or remove the tool message."
            )


def chat_messages(messages: list[dict]) -> list[dict]:
    """``messages`` as chat templates expect them: a tool call's ``arguments`` given as a string holding a JSON object
    (the OpenAI shape; ``validate_messages`` refuses any other string) parsed to the object, so a template renders
    the call as it renders the object form (the shipped template would render ``"arguments": "{\\"expression\\":
    ...}"``, and the model learn to write a quoted string). Everything else is passed on as it is."""
    out = list(messages)
    for i, msg in enumerate(messages):
        calls = msg.get("tool_calls") if isinstance(msg, dict) else None
        if not isinstance(calls, list):
            continue
        parsed = [_with_object_arguments(call) for call in calls]
        if any(new is not old for new, old in zip(parsed, calls)):
            out[i] = {**msg, "tool_calls": parsed}
    return out


def _with_object_arguments(call: Any) -> Any:
    """``call`` with string ``arguments`` that hold a JSON object replaced by the object (a new dict), else ``call``."""
    function = _function_of(call)
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    arguments, _ = _arguments_object(function["arguments"])
    if arguments is None:
        return call
    function = {**function, "arguments": arguments}
    return {**call, "function": function} if "function" in call else function  # the shape it came in


# --------------------------------------------------------------------------------------------- chat templates
def check_chat_template(tokenizer: Any, source: str) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataFormatError(
            f"The data is conversational ({source}) but the tokenizer '{getattr(tokenizer, 'name_or_path', '?')}' "
            "has no chat template. Use a tokenizer that has one (an instruct model's), or pass "
            "data.chat_template (a Jinja template string or a path to a .jinja file)."
        )


def resolve_chat_template(template: str | None) -> str | None:
    """A chat template given inline or as a path to a file."""
    if template is None:
        return None
    path = Path(template).expanduser()
    if len(template) < 512 and "{%" not in template and "{{" not in template:
        if not path.is_file():
            raise DataFormatError(f"chat_template '{template}' is neither a Jinja template nor an existing file.")
        return path.read_text()
    return template


def render_prompt_completion(tokenizer: Any, prompt: list[dict], completion: list[dict]) -> tuple[str, str]:
    """Conversational prompt/completion as template text: (prompt with generation prompt, completion suffix); tool
    calls as ``chat_messages`` gives them."""
    prompt, completion = chat_messages(prompt), chat_messages(completion)
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    if not full_text.startswith(prompt_text):
        # Templates that rewrite earlier turns (e.g. strip reasoning) break the prefix property.
        raise DataFormatError(
            "The chat template renders the prompt differently when the completion follows it, so the completion "
            "tokens cannot be separated from the prompt. Use a template whose rendering of the prompt is a prefix."
        )
    return prompt_text, full_text[len(prompt_text) :]
