"""TRL GKD's data format for DistillModule: conversational language-modeling rows (a ``messages`` column) become
prompt-completion rows, the last (assistant) message the completion; a conversation that cannot be split is refused
naming its row."""

from __future__ import annotations

import pytest

from lightalign.datamodules import PromptDataModule
from lightalign.datamodules.formats import DataFormatError


def conversation(i: int) -> list[dict]:
    return [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": f"{i}+1="},
            {"role": "assistant", "content": str(i + 1)}]


def test_messages_rows_are_split_at_the_last_assistant_message(tiny_dir, write_jsonl):
    """Mutations: the whole conversation as the prompt -> fails; the split left out -> the 'prompt' column refusal."""
    dm = PromptDataModule(write_jsonl([{"messages": conversation(i)} for i in range(8)]), tokenizer=str(tiny_dir),
                          shuffle=False)
    dm.setup("fit")
    batch = dm.collate_fn()([dm.train_dataset[i] for i in range(2)])
    assert batch["prompts"] == [conversation(0)[:-1], conversation(1)[:-1]]
    assert batch["columns"]["completion"] == [conversation(0)[-1:], conversation(1)[-1:]]


@pytest.mark.parametrize("bad, message", [
    ([{"role": "user", "content": "1+1="}], r"row 3, column 'messages': .* end with an assistant message"),
    ([{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "?"}],
     r"row 3, column 'messages': .* end with an assistant message"),
])
def test_a_conversation_that_cannot_be_split_names_its_row(tiny_dir, write_jsonl, bad, message):
    rows = [{"messages": conversation(i)} for i in range(6)]
    rows[3]["messages"] = bad
    dm = PromptDataModule(write_jsonl(rows), tokenizer=str(tiny_dir), shuffle=False)
    with pytest.raises(DataFormatError, match=message):
        dm.setup("fit")
