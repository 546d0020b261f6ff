"""Built-in reward functions with TRL's signature: ``fn(prompts, completions, **columns) -> list[float | None]``.

A completion is a string (standard prompts) or a list of messages ``[{"role": "assistant", "content": ...}]``
(conversational prompts). Extra dataset columns arrive as keyword lists, one entry per completion. ``None`` means
"not applicable to this row": the row is left out of that function's contribution to the total reward.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any

__all__ = [
    "FormatReward",
    "LengthPenalty",
    "accuracy_reward",
    "completion_text",
    "digit_fraction_reward",
    "extract_last_number",
    "make_format_reward",
    "think_format_reward",
]


def completion_text(completion: Any) -> str:
    """The text of one completion: the string itself, or the contents of its messages joined by newlines.

    Message content may be a string or a list of content blocks (``{"type": "text", "text": ...}``).
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    parts = []
    for message in completion:
        content = message.get("content") if isinstance(message, dict) else message
        if content is None:
            continue
        if isinstance(content, list):  # multimodal content blocks: keep the text ones
            content = "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
        parts.append(str(content))
    return "\n".join(parts)


# A number: "1,234.5" (thousands separators), "-3", "0.25", ".5". A minus sign counts only when it does not
# follow a word character, so "3-5" reads as 3 and 5 rather than 3 and -5.
_NUMBER = re.compile(r"(?:(?<![\w])[-\u2212])?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")


def _to_float(token: str) -> float | None:
    try:
        return float(token.replace(",", "").replace("\u2212", "-"))
    except ValueError:
        return None


def extract_last_number(text: str) -> float | None:
    """The last number written in ``text`` (negatives, decimals and ``1,000``-style separators), or None."""
    matches = _NUMBER.findall(text)
    return _to_float(matches[-1]) if matches else None


def _answer_number(answer: str) -> float | None:
    """The answer as a number when the whole answer is one number (``"1,234"``, ``"$5"``, ``"-0.5"``)."""
    cleaned = answer.strip().lstrip("$").rstrip(".").strip()
    return _to_float(cleaned) if _NUMBER.fullmatch(cleaned) else None


def _math_verify_equal(answer: str, text: str) -> bool:
    """True when ``math_verify`` is installed, parses both sides and finds them equal."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    # math_verify times out with signal.alarm, which only works in the main thread (TRL does the same).
    main = threading.current_thread() is threading.main_thread()
    try:
        gold = parse(answer, parsing_timeout=10 if main else None)
        pred = parse(text, parsing_timeout=10 if main else None)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=5 if main else None))
    except Exception:  # a parser failure means "not shown equal", never a crashed training step
        return False


def accuracy_reward(
    prompts: list, completions: list, answer: list | None = None, solution: list | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's answer matches the ``answer`` column, else 0.0; None where the answer is missing.

    TRL's column name ``solution`` is accepted when there is no ``answer`` column.

    A completion matches when any of these holds: its stripped text equals the stripped answer; the last number
    in it equals the answer numerically (``"The answer is 1,234."`` matches ``"1234"``, tolerance 1e-6);
    ``math_verify`` (if installed) parses both and verifies them equal (e.g. LaTeX ``\\frac{1}{2}`` vs ``0.5``).
    """
    if answer is None:
        answer = solution
    if answer is None:
        raise ValueError("accuracy_reward needs an 'answer' (or 'solution') column in the dataset.")
    rewards: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None or str(gold).strip() == "":
            rewards.append(None)
            continue
        gold, text = str(gold).strip(), completion_text(completion).strip()
        correct = text == gold
        if not correct:
            gold_num, pred_num = _answer_number(gold), extract_last_number(text)
            correct = gold_num is not None and pred_num is not None and math.isclose(gold_num, pred_num, abs_tol=1e-6)
        if not correct:
            correct = _math_verify_equal(gold, text)
        rewards.append(1.0 if correct else 0.0)
    return rewards


_FLAG_NAMES = {"ASCII", "IGNORECASE", "LOCALE", "MULTILINE", "DOTALL", "VERBOSE", "UNICODE", *"AILMSXU"}


def _parse_flags(flags: int | str) -> int:
    """``re`` flags as an int or as names (``"DOTALL|MULTILINE"``), so YAML can set them."""
    if isinstance(flags, int):
        return flags
    value = 0
    for name in filter(None, (part.strip().removeprefix("re.").upper() for part in str(flags).split("|"))):
        if name not in _FLAG_NAMES:
            raise ValueError(f"Unknown regex flag '{name}' in flags={flags!r}; use names like DOTALL|MULTILINE.")
        value |= getattr(re, name)
    return value


class FormatReward:
    """1.0 when the whole completion matches ``pattern`` (``re.fullmatch``), else 0.0.

    YAML: ``class_path: lightalign.rewards.FormatReward`` with ``init_args: {pattern: "...", flags: DOTALL}``.
    ``name`` sets the metric name (default ``format_reward``).
    """

    def __init__(self, pattern: str, flags: int | str = re.DOTALL, name: str = "format_reward"):
        try:
            self.regex = re.compile(pattern, _parse_flags(flags))
        except re.error as err:
            raise ValueError(f"FormatReward pattern {pattern!r} is not a valid regular expression: {err}") from err
        self.pattern = pattern
        self.__name__ = name

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        return [1.0 if self.regex.fullmatch(completion_text(c)) else 0.0 for c in completions]

    def __repr__(self) -> str:
        return f"FormatReward(pattern={self.pattern!r}, name={self.__name__!r})"


def make_format_reward(pattern: str, flags: int | str = re.DOTALL, name: str = "format_reward") -> FormatReward:
    """A reward function giving 1.0 when ``re.fullmatch(pattern, completion)``, else 0.0 (a picklable object)."""
    return FormatReward(pattern, flags=flags, name=name)


# TRL's think format: starts with <think>, no second <think>, a </think> somewhere, anything after it.
_THINK = re.compile(r"<think>(?!.*<think>).*?</think>.*", re.DOTALL)


def think_format_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion is ``<think>...</think>`` followed by the answer (TRL's pattern), else 0.0.

    The completion must start with ``<think>``, contain ``</think>`` and no second ``<think>``.
    """
    return [1.0 if _THINK.fullmatch(completion_text(c)) else 0.0 for c in completions]


class LengthPenalty:
    """Linear penalty on the length beyond ``max_length``: ``-penalty * max(0, length - max_length)``.

    0.0 for completions within the limit, so it never rewards being short. ``unit`` is ``"chars"``,
    ``"words"`` (whitespace-separated) or ``"tokens"`` (needs the ``completion_ids`` keyword, which the
    trainer passes, as TRL does).
    """

    units = ("chars", "words", "tokens")

    def __init__(self, max_length: int = 100, penalty: float = 0.01, unit: str = "chars", name: str = "length_penalty"):
        if unit not in self.units:
            raise ValueError(f"LengthPenalty unit={unit!r} is not one of {list(self.units)}.")
        if max_length < 0 or penalty < 0:
            raise ValueError(f"LengthPenalty needs max_length >= 0 and penalty >= 0, got {max_length} and {penalty}.")
        self.max_length, self.penalty, self.unit = int(max_length), float(penalty), unit
        self.__name__ = name

    def _lengths(self, completions: list, completion_ids: list | None) -> list[int]:
        if self.unit == "tokens":
            if completion_ids is None:
                raise ValueError("LengthPenalty(unit='tokens') needs the completion_ids keyword argument.")
            return [len(ids) for ids in completion_ids]
        texts = [completion_text(c) for c in completions]
        return [len(t) if self.unit == "chars" else len(t.split()) for t in texts]

    def __call__(
        self, prompts: list, completions: list, completion_ids: list | None = None, **kwargs: Any
    ) -> list[float]:
        lengths = self._lengths(completions, completion_ids)
        return [-self.penalty * max(0, n - self.max_length) for n in lengths]

    def __repr__(self) -> str:
        return f"LengthPenalty(max_length={self.max_length}, penalty={self.penalty}, unit={self.unit!r})"


def digit_fraction_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """The fraction of the completion's non-space characters that are ASCII digits (0.0 for an empty completion)."""
    rewards = []
    for completion in completions:
        chars = [ch for ch in completion_text(completion) if not ch.isspace()]
        rewards.append(sum(ch in "0123456789" for ch in chars) / len(chars) if chars else 0.0)
    return rewards
