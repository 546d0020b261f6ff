"""What the self-distillation teacher reads before the student's completion: its prompt.

SDFT (``DemonstrationPrompts``): the row's prompt with its privileged context (the ``privileged_context`` column:
a demonstration, a solution, a document) put in by ``teacher_prompt_template``. SDPO (``Reprompts``): the prompt
with a successful completion of the same group (another completion whose reward reaches
``success_reward_threshold``) and, when asked, the environment's feedback on this completion (the row's
``privileged_context``), through ``reprompt_template`` / ``solution_template`` / ``feedback_template``; a completion
with neither keeps its own prompt and takes no distillation loss.

A conversational prompt keeps its messages before the last; the last (the user's) is rewritten with the template.
Both read TRL 1.16's knob names and defaults. Rows that cannot be made a teacher prompt (no privileged context, a
conversation not ending with a user turn) are refused at fit start naming the row and the column
(``check_demonstration_rows``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Sequence

from lightalign.datamodules.formats import DataFormatError, MissingColumnError, iter_rows
from lightalign.knobs import KnobGroup, knob

CONTEXT_COLUMN = "privileged_context"


def _check_template(name: str, template: str, fields: Sequence[str], required: Sequence[str]) -> None:
    missing = [f for f in required if "{" + f + "}" not in template]
    if missing:
        raise ValueError(f"{name} must contain the placeholder(s) {', '.join('{' + f + '}' for f in missing)}; got "
                         f"{template!r}.")
    try:
        template.format(**{f: "" for f in fields})
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"{name} {template!r} is not a template of {', '.join('{' + f + '}' for f in fields)} "
                         f"({type(err).__name__}: {err}); write a literal brace as '{{{{' or '}}}}'.") from None


@dataclasses.dataclass(frozen=True)
class TeacherPromptKnobs(KnobGroup):
    """SDFT's teacher prompt: the student's prompt with the row's privileged context."""

    group = "teacher_prompt"
    teacher_prompt_template: str = knob(
        "{prompt}\n\n{privileged_context}", "the teacher's prompt (for a conversation: its last user message) from "
                                            "the student's ``{prompt}`` and the row's ``{privileged_context}``.")

    def check(self) -> None:
        _check_template("teacher_prompt_template", self.teacher_prompt_template, ("prompt", "privileged_context"),
                        ("prompt", "privileged_context"))


def context_text(value: Any) -> str:
    """A privileged context as text: a string as it is, a list of messages as their texts one per line."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        texts = []
        for message in value:
            content = message.get("content", "")
            text = (" ".join(p.get("text", "") for p in content if p.get("type") == "text")
                    if isinstance(content, list) else str(content))
            if text:
                texts.append(text)
        return "\n".join(texts)
    return str(value)


def last_user_text(messages: list[dict[str, Any]]) -> str:
    content = messages[-1].get("content", "")
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if p.get("type") == "text")
    return content


def rewrite_prompt(prompt: Any, write: Callable[[str], str]) -> Any:
    """``prompt`` with its text (a conversation: its last, user, message) replaced by ``write(text)``."""
    if isinstance(prompt, list):
        return [*prompt[:-1], {"role": "user", "content": write(last_user_text(prompt))}]
    return write(prompt)


def check_prompt_rows(dataset: Any, label: str, needs_context: bool, method: str) -> None:
    """Every row's prompt can be rewritten (a conversation ends with a user message) and, ``needs_context``, has a
    ``privileged_context``: refused naming the row and the column, before any rollout."""
    columns = list(getattr(dataset, "column_names", None) or [])
    if needs_context and CONTEXT_COLUMN not in columns:
        raise DataFormatError(
            f"{method} builds the teacher's prompt from each row's '{CONTEXT_COLUMN}' column (the demonstration or "
            f"context only the teacher sees), but the {label} data has {sorted(columns)}. Add the column, or rename "
            f"the one holding it to '{CONTEXT_COLUMN}'.")
    for i, row in iter_rows(dataset, ["prompt", *([CONTEXT_COLUMN] if needs_context else [])]):
        prompt = row["prompt"]
        if isinstance(prompt, list) and (not prompt or not isinstance(prompt[-1], dict)
                                         or prompt[-1].get("role") != "user"):
            role = prompt[-1].get("role") if prompt and isinstance(prompt[-1], dict) else None
            raise DataFormatError(
                f"{label} row {i}, column 'prompt': {method} rewrites the conversation's last user message into the "
                f"teacher's prompt, but it ends with a {role!r} message. End each prompt with the user's turn.")
        if needs_context and row[CONTEXT_COLUMN] is None:
            raise MissingColumnError(i, CONTEXT_COLUMN, [c for c in columns if c != CONTEXT_COLUMN],
                                     f"{method}'s teacher reads the row's privileged context; give every {label} "
                                     "row one.")


class DemonstrationPrompts:
    """SDFT's teacher prompts: ``teacher_prompt_template`` over each row's prompt and privileged context."""

    def __init__(self, knobs: TeacherPromptKnobs) -> None:
        self.template = knobs.teacher_prompt_template

    def __call__(self, prompts: Sequence[Any], contexts: Sequence[Any]) -> list[Any]:
        return [rewrite_prompt(p, lambda text, c=c: self.template.format(prompt=text,
                                                                          privileged_context=context_text(c)))
                for p, c in zip(prompts, contexts, strict=True)]


@dataclasses.dataclass(frozen=True)
class RepromptKnobs(KnobGroup):
    """SDPO's teacher prompt: the prompt with a successful completion of its group and/or environment feedback."""

    group = "reprompt"
    use_successful_as_teacher: bool = knob(
        True, "a completion whose group has a successful completion (reward >= ``success_reward_threshold``) is "
              "distilled towards the teacher shown that success.")
    success_reward_threshold: float = knob(1.0, "the reward at which a completion counts as successful.")
    dont_reprompt_on_self_success: bool = knob(
        True, "a completion is never shown itself: the demonstration is another successful completion of the group.")
    max_reprompt_len: int = knob(10240, "the teacher's prompt keeps its last ``max_reprompt_len`` tokens.")
    reprompt_template: str = knob(
        "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n",
        "the teacher's prompt (a conversation: its last user message) from ``{prompt}``, ``{solution}`` "
        "(``solution_template`` or empty) and ``{feedback}`` (``feedback_template`` or empty).")
    solution_template: str = knob("\nCorrect solution:\n\n{successful_previous_attempt}\n\n",
                                  "how a successful completion is shown (``{successful_previous_attempt}``).")
    feedback_template: str = knob(
        "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n",
        "how the row's feedback (its ``privileged_context``) is shown (``{feedback_raw}``).")
    include_environment_feedback: bool = knob(
        False, "show the row's ``privileged_context`` (environment feedback) to the teacher when it is a non-empty "
               "string.")
    environment_feedback_only_without_solution: bool = knob(
        False, "show the feedback only to completions whose group has no successful completion to show.")
    remove_thinking_from_demonstration: bool = knob(
        False, "drop ``<think>...</think>`` blocks from the successful completion shown.")

    def check(self) -> None:
        if self.max_reprompt_len < 1:
            raise ValueError(f"max_reprompt_len must be >= 1, got {self.max_reprompt_len}.")
        _check_template("reprompt_template", self.reprompt_template, ("prompt", "solution", "feedback"),
                        ("prompt",))
        _check_template("solution_template", self.solution_template, ("successful_previous_attempt",),
                        ("successful_previous_attempt",))
        _check_template("feedback_template", self.feedback_template, ("feedback_raw",), ("feedback_raw",))


class Reprompts:
    """SDPO's teacher prompts for one rollout (whole groups of ``num_generations`` consecutive completions)."""

    def __init__(self, knobs: RepromptKnobs) -> None:
        self.knobs = knobs

    def demonstration(self, i: int, rewards: Sequence[float], group: int) -> int | None:
        """The completion shown to completion ``i``'s teacher: the first successful one of its group (never ``i``
        itself with ``dont_reprompt_on_self_success``), or None."""
        k = self.knobs
        if not k.use_successful_as_teacher:
            return None
        start = (i // group) * group
        for j in range(start, start + group):
            if (j != i or not k.dont_reprompt_on_self_success) and rewards[j] >= k.success_reward_threshold:
                return j
        return None

    def __call__(self, prompts: Sequence[Any], texts: Sequence[str], rewards: Sequence[float],
                 feedbacks: Sequence[Any] | None, group: int) -> tuple[list[Any], list[bool], dict[str, float]]:
        """(each completion's teacher prompt, whether it is distilled, the rollout's statistics) from the prompts,
        the completions' decoded texts and their rewards, in the rollout's order."""
        k = self.knobs
        n = len(prompts)
        feedbacks = feedbacks if feedbacks is not None else [None] * n
        out, active = [], []
        solved = used_feedback = has_feedback = 0
        for i in range(n):
            demo = self.demonstration(i, rewards, group)
            feedback = feedbacks[i]
            available = isinstance(feedback, str) and feedback.strip() != ""
            has_feedback += available
            use_feedback = k.include_environment_feedback and available and \
                (demo is None or not k.environment_feedback_only_without_solution)
            if demo is None and not use_feedback:
                out.append(prompts[i])
                active.append(False)
                continue
            solution = ""
            if demo is not None:
                shown = texts[demo]
                if k.remove_thinking_from_demonstration:
                    shown = re.sub(r"<think>.*?</think>", "", shown, flags=re.DOTALL).strip()
                solution = k.solution_template.format(successful_previous_attempt=shown)
                solved += 1
            note = k.feedback_template.format(feedback_raw=feedback) if use_feedback else ""
            used_feedback += use_feedback
            out.append(rewrite_prompt(prompts[i], lambda text, s=solution, f=note: k.reprompt_template.format(
                prompt=text, solution=s, feedback=f)))
            active.append(True)
        groups = max(1, n // group)
        successful_groups = sum(any(r >= k.success_reward_threshold for r in rewards[g * group:(g + 1) * group])
                                for g in range(n // group))
        stats = {"success_group_fraction": successful_groups / groups, "success_sample_fraction": solved / max(1, n),
                 "feedback_used_fraction": used_feedback / max(1, n),
                 "reprompt_sample_fraction": sum(active) / max(1, n)}
        return out, active, stats
