"""TRL GKD's data format for DistillModule: conversational language-modeling rows (a ``messages`` column) become
prompt-completion rows, the last (assistant) message the completion; a conversation that cannot be split is refused
naming its row; the fit-start note counts the split rows and says what each method does with that last message (the
console shows it: tests/online_dpo/test_online_dpo.py's console run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightalign import DistillModule
from lightalign.datamodules import PromptDataModule
from lightalign.datamodules.formats import DataFormatError
from lightalign.datamodules.prompt import conversation_split_note
from lightalign.modules.sampling.module import SamplingModule


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
    assert dm.conversation_rows == {"train": 8}  # the fit-start note's count (mutation: not recorded -> fails)


@pytest.mark.parametrize("method, hparams, use", [
    (DistillModule, {"lmbda": 0.5, "seq_kd": False},
     "is the completion of the 50% of batches the student does not sample (lmbda 0.5); the others drop it"),
    (DistillModule, {"lmbda": 1.0, "seq_kd": False},
     "is dropped: the student samples every batch's completions (lmbda 1)"),
    (DistillModule, {"lmbda": 0.25, "seq_kd": True},
     "is dropped: the student (lmbda 0.25) or the teacher (seq_kd) samples every batch's completions"),
    (SamplingModule, {}, "is dropped for online sampling: the policy samples its own completions"),
])
def test_the_fit_start_note_says_what_each_method_does_with_the_last_assistant_message(method, hparams, use):
    """Mutation: DistillModule without its own data_completion_use (the sampling methods' text) -> its rows fail."""
    module = SimpleNamespace(hparams=SimpleNamespace(**hparams))
    assert method.data_completion_use(module) == use
    assert conversation_split_note("Distillation", {"validation": 16, "train": 984}, use) == (
        "Distillation: 984 train and 16 validation rows are conversations ('messages'): the messages before each "
        f"one's last assistant message are its prompt; that last message {use}.")


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
