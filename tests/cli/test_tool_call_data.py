"""Tool-calling rows (#48): a call's ``arguments`` given as a JSON string (the OpenAI shape, common in TRL datasets)
train the same tokens as the object form, a string that holds no JSON object is refused, and every ``tool`` message
answers a call of the assistant message before it (``formats.chat_messages``, ``formats.validate_messages``).

Refusals name the data file's line, the row (numbered from 0 in the user's data), the column and the message, and
come before anything is tokenized or any model is loaded. The rows are the shipped demo's
(``examples/data/tool_sft.jsonl``, rendered by the shipped tiny tokenizer's template, which writes a call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from helpers import console_script

from lightalign import DataFormatError, PreferenceDataModule, PromptDataModule, SFTDataModule
from lightalign.datamodules.unpaired import UnpairedPreferenceDataModule


def shipped_rows(data_dir: Path, n: int = 8) -> list[dict]:
    """The first ``n`` rows of the tool-calling demo: user, assistant with one call, tool, assistant (and ``tools``)."""
    return [json.loads(line) for line in (data_dir / "tool_sft.jsonl").read_text().splitlines()[:n]]


def with_string_arguments(row: dict) -> dict:
    """``row`` (any format) with the ``arguments`` of every call in its conversations written as a JSON string, as
    OpenAI's API and many TRL datasets hold them."""
    row = copy.deepcopy(row)
    for conversation in (value for value in row.values() if isinstance(value, list)):
        for message in conversation:
            for call in message.get("tool_calls") or []:
                if isinstance(call["function"]["arguments"], dict):  # (a message two columns share: once)
                    call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return row


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------------------------- arguments as a string
def test_string_arguments_train_the_tokens_of_the_object_form(tiny_dir, data_dir, tmp_path):
    """The shipped demo's setting (conversations with a ``tools`` column, ``assistant_only_loss``): the rows with
    string arguments give the same ids and loss mask as the rows with objects, and the call is rendered as an object.
    (Mutation: ``chat_messages`` returning the messages unchanged -> the template renders
    ``"arguments": "{\\"expression\\": ...}"`` and the ids differ.)"""
    rows = shipped_rows(data_dir)
    as_object = write_rows(tmp_path / "object.jsonl", rows)
    as_string = write_rows(tmp_path / "string.jsonl", [with_string_arguments(r) for r in rows])
    made = []
    for path in (as_object, as_string):
        dm = SFTDataModule(str(path), tokenizer=str(tiny_dir), assistant_only_loss=True, max_length=384)
        dm.setup("fit")
        made.append(dm)
    assert made[1].train_dataset.to_dict() == made[0].train_dataset.to_dict()
    text = made[1].tokenizer.decode(made[1].train_dataset[0]["input_ids"])
    assert '<tool_call>{"name": "calculate", "arguments": {"expression": "52+30"}}</tool_call>' in text, text


def split_rows(rows: list[dict], kind: str) -> list[dict]:
    """The demo's conversations in another TRL format (each cut after the user's question, or, for prompt-only
    data, kept up to the tool's answer so that the prompt holds the call)."""
    out = []
    for row in rows:
        m = row["messages"]
        if kind == "prompt_completion":
            out.append({"prompt": m[:1], "completion": m[1:]})
        elif kind == "preference":
            wrong = [*m[1:3], {"role": "assistant", "content": "0"}]
            out.append({"prompt": m[:1], "chosen": m[1:], "rejected": wrong})
        elif kind == "unpaired":
            out.append({"prompt": m[:1], "completion": m[1:], "label": len(out) % 2 == 0})
        else:
            out.append({"prompt": m[:3]})
    return out


DATAMODULES = {"prompt_completion": SFTDataModule, "preference": PreferenceDataModule,
               "unpaired": UnpairedPreferenceDataModule, "prompt": PromptDataModule}


@pytest.mark.parametrize("kind", list(DATAMODULES))
def test_string_arguments_give_the_object_forms_tokens_in_every_conversational_format(tiny_dir, data_dir, tmp_path,
                                                                                      kind):
    """Prompt-completion (SFT), preference (DPO), unpaired (KTO) and prompt-only (GRPO) rows with a call in them:
    the string form gives the object form's tokenized rows; the prompt-only batches hand on the prompts with object
    arguments, which tool rollouts render again (mutation: ``chat_messages`` passing strings on -> every case fails)."""
    rows = split_rows(shipped_rows(data_dir), kind)
    made = []
    for name, data in (("object", rows), ("string", [with_string_arguments(r) for r in rows])):
        dm = DATAMODULES[kind](str(write_rows(tmp_path / f"{name}.jsonl", data)), tokenizer=str(tiny_dir))
        dm.setup("fit")
        made.append(dm)
    tokenized = [c for c in made[0].train_dataset.column_names if c != "prompt"]  # prompt-only data keeps its prompts
    assert made[1].train_dataset.select_columns(tokenized).to_dict() == made[0].train_dataset.select_columns(
        tokenized).to_dict()
    if kind == "prompt":
        batches = [dm.collate_fn()([dm.train_dataset[i] for i in range(2)]) for dm in made]
        assert batches[1]["prompts"] == batches[0]["prompts"]
        assert isinstance(batches[1]["prompts"][0][1]["tool_calls"][0]["function"]["arguments"], dict)


@pytest.mark.parametrize("arguments, why", [
    ('{"expression": "52+30"', r"the string is not valid JSON: Expecting ',' delimiter at character 23"),
    ('["52+30"]', r"the string holds a list"),
    ('"52+30"', r"the string holds a string"),
])
def test_arguments_that_are_no_json_object_are_refused_naming_line_row_and_message(tiny_dir, data_dir, tmp_path,
                                                                                   arguments, why):
    """Row 5 (line 6) of 8 with arguments that no template renders as an object: refused with the file's line, the
    row, the column, the message and the call, before tokenizing."""
    rows = [with_string_arguments(r) for r in shipped_rows(data_dir)]
    rows[5]["messages"][1]["tool_calls"][0]["function"]["arguments"] = arguments
    path = write_rows(tmp_path / "calls.jsonl", rows)
    with pytest.raises(DataFormatError, match=rf"train data '.*calls.jsonl', line 6: row 5, column 'messages', "
                                              rf"message 1 \(assistant\), tool call 0 \('calculate'\): 'arguments' .* "
                                              rf"is not a JSON object \({why}\)\. Write them as an object"):
        SFTDataModule(str(path), tokenizer=str(tiny_dir)).setup("fit")


@pytest.mark.parametrize("arguments, why", [(52, "it is a number"), (["52+30"], "it is a list"), ("", "the string is "
                                                                                                  "not valid JSON")])
def test_arguments_of_another_type_are_refused(data_dir, arguments, why):
    """Values a file cannot mix with the other rows' objects or strings (its one-type-per-column check refuses them
    first), given in a ``Dataset``: refused by the row check, naming the row, message and call."""
    from lightalign.datamodules.formats import validate_messages

    messages = with_string_arguments(shipped_rows(data_dir, 1)[0])["messages"]
    messages[1]["tool_calls"][0]["function"]["arguments"] = arguments
    with pytest.raises(DataFormatError, match=rf"row 7, column 'chosen', message 1 \(assistant\), tool call 0 "
                                              rf"\('calculate'\): 'arguments' .* is not a JSON object \({why}"):
        validate_messages(messages, 7, "chosen")
    messages[1]["tool_calls"][0]["function"]["arguments"] = None  # no arguments: left to the template
    validate_messages(messages, 7, "chosen")


# --------------------------------------------------------------------------------------------- tool messages
def demo_messages(data_dir: Path) -> list[dict]:
    return shipped_rows(data_dir, 1)[0]["messages"]  # user, assistant with one call, tool, assistant


@pytest.mark.parametrize("shape, match", [
    ("no assistant before", r"message 1 \(tool\): a tool message answers a tool call of the assistant message before "
                            r"it, but no assistant message comes before it\. Add the assistant message"),
    ("assistant without a call", r"message 2 \(tool\): .* but the assistant message before it \(message 1\) made no "
                                 r"tool call\. Give message 1 the call in 'tool_calls'"),
    ("more answers than calls", r"message 3 \(tool\): .* but it is tool message 2 after message 1 \(assistant\), which "
                                r"made 1 tool call\(s\)\. Give message 1 one call per tool message"),
])
def test_a_tool_message_without_a_call_to_answer_is_refused(tiny_dir, data_dir, tmp_path, shape, match):
    """Row 3 (line 4) of 6; mutation: ``_check_tool_answers`` removed -> the rows train and every case fails."""
    user, call, tool, answer = demo_messages(data_dir)
    bad = {"no assistant before": [user, tool, answer],
           "assistant without a call": [user, {"role": "assistant", "content": "Let me see."}, tool, answer],
           "more answers than calls": [user, call, tool, tool, answer]}[shape]
    rows = [{"messages": [user, call, tool, answer]} for _ in range(6)]
    rows[3] = {"messages": bad}
    with pytest.raises(DataFormatError, match=r"train data '.*data.jsonl', line 4: row 3, column 'messages', " + match):
        SFTDataModule(str(write_rows(tmp_path / "data.jsonl", rows)), tokenizer=str(tiny_dir)).setup("fit")


def test_tool_messages_answering_their_calls_are_accepted_and_counted_across_prompt_and_completion(
        tiny_dir, data_dir, tmp_path):
    """Two calls answered by two tool messages, and prompts that end with the tool's answer (prompt-completion and
    preference rows), are accepted. A prompt and its completion are one conversation: a completion whose first
    message answers the prompt's call a second time is refused counting that call (without the prompt it would be
    said to follow no assistant message)."""
    user, call, tool, answer = demo_messages(data_dir)
    two_calls = {**call, "tool_calls": call["tool_calls"] * 2}
    chats = write_rows(tmp_path / "chats.jsonl", [{"messages": [user, two_calls, tool, tool, answer]}] * 2)
    SFTDataModule(str(chats), tokenizer=str(tiny_dir)).setup("fit")
    pairs = [{"prompt": [user, call, tool], "chosen": [answer], "rejected": [{**answer, "content": "0"}]}] * 2
    PreferenceDataModule(str(write_rows(tmp_path / "pairs.jsonl", pairs)), tokenizer=str(tiny_dir)).setup("fit")
    rows = [{"prompt": [user, call, tool], "completion": [answer]} for _ in range(3)]
    SFTDataModule(str(write_rows(tmp_path / "ok.jsonl", rows)), tokenizer=str(tiny_dir)).setup("fit")
    rows[2]["completion"] = [tool, answer]
    with pytest.raises(DataFormatError, match=r"line 3: row 2, column 'completion', message 0 \(tool\): .* it is tool "
                                              r"message 2 after message 1 of the prompt \(assistant\), which made 1"):
        SFTDataModule(str(write_rows(tmp_path / "bad.jsonl", rows)), tokenizer=str(tiny_dir)).setup("fit")


# --------------------------------------------------------------------------------------------- console
console_refusal = console_script.data_refusal


@pytest.mark.slow
@pytest.mark.parametrize("case", ["arguments not an object", "tool message without a call"])
def test_console_tool_rows_are_refused_in_one_line(repo, data_dir, tmp_path, case):
    """The shipped tool-calling config on 40 of its rows with row 30 (line 31) broken, 8 rows carved out for
    validation: refused before the model loads, naming the line, the row and the message."""
    rows = [with_string_arguments(r) for r in shipped_rows(data_dir, 40)]
    if case == "arguments not an object":
        rows[30]["messages"][1]["tool_calls"][0]["function"]["arguments"] = "expression=52+30"
        expected = ("line 31: row 30, column 'messages', message 1 (assistant), tool call 0 ('calculate'): "
                    "'arguments' 'expression=52+30' is not a JSON object (the string is not valid JSON: Expecting "
                    "value at character 1).")
    else:
        del rows[30]["messages"][1]["tool_calls"]
        rows[30]["messages"][1]["content"] = "Let me calculate."
        expected = ("line 31: row 30, column 'messages', message 2 (tool): a tool message answers a tool call of the "
                    "assistant message before it, but the assistant message before it (message 1) made no tool call.")
    path = write_rows(tmp_path / "tools.jsonl", rows)
    line = console_refusal(repo, "fit", "--config", "configs/tools_sft.yaml", "--data.path", str(path),
                           "--data.val_split_size", "8", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"))
    assert line.startswith("lightalign: error: ") and expected in line, line
