"""PreferenceDataModule's prompt/completion split: implicit prompts, token boundaries, truncation defaults."""

from __future__ import annotations

import pytest

from lightalign import PreferenceDataModule
from lightalign.datamodules.formats import DataFormatError
from lightalign.datamodules.preference import extract_prompt


def _rows(path, tiny_dir, **kw):
    dm = PreferenceDataModule(str(path), tokenizer=str(tiny_dir), **kw)
    dm.setup("fit")
    return [dm.train_dataset[i] for i in range(len(dm.train_dataset))]


def test_implicit_prompt_leaves_both_completions_non_empty():
    # one completion extends the other: the shared answer must not swallow 'chosen' whole
    assert extract_prompt("Q: 5+6=\n1", "Q: 5+6=\n11", 0) == ("Q: 5+6=\n", "1", "11")
    assert extract_prompt("Q: 5+6=\n11", "Q: 5+6=\n1", 0) == ("Q: 5+6=\n", "11", "1")
    assert extract_prompt("Q: 1+1= 2", "Q: 1+1= 3", 0) == ("Q: 1+1=", " 2", " 3")
    user = {"role": "user", "content": "hi"}
    answer = {"role": "assistant", "content": "a"}
    more = {"role": "user", "content": "more"}
    # a conversation that continues the other one keeps its last shared turn as its completion
    assert extract_prompt([user, answer], [user, answer, more], 0) == ([user], [answer], [answer, more])


def test_implicit_prompt_that_cannot_be_split_names_the_row(tiny_dir, write_jsonl):
    with pytest.raises(DataFormatError, match=r"row 7: 'chosen' and 'rejected' share no prefix"):
        extract_prompt("1", "11", 7)
    rows = [{"chosen": "Q: 5+6=\n11", "rejected": "Q: 5+6=\n12"}, {"chosen": "1", "rejected": "11"}]
    with pytest.raises(DataFormatError, match=r"row 1: "):
        _rows(write_jsonl(rows), tiny_dir)


def test_implicit_prefix_pair_trains_on_the_answer_not_on_eos_alone(tiny_dir, write_jsonl, tokenizer):
    row = _rows(write_jsonl([{"chosen": "Q: 5+6=\n1", "rejected": "Q: 5+6=\n11"}]), tiny_dir)[0]
    eos = tokenizer.eos_token_id
    assert tokenizer.decode(row["chosen_input_ids"]) == "1" + tokenizer.eos_token
    assert tokenizer.decode(row["rejected_input_ids"]) == "11" + tokenizer.eos_token
    assert row["chosen_input_ids"][-1] == eos and len(row["chosen_input_ids"]) == 2


@pytest.mark.parametrize("rows", [
    # implicit prompts whose character split falls inside a word ("...\nThe" | " cat" vs "...\nThe" | "y")
    [{"chosen": "Q: who?\nThe cat sat.", "rejected": "Q: who?\nThey sat."},
     {"chosen": "Hello world", "rejected": "Hello wor"}],
    # an explicit prompt that ends mid-word
    [{"prompt": "Q: who?\nTh", "chosen": "e cat sat.", "rejected": "ey sat."}],
])
def test_sequences_are_the_tokenizers_own_output_of_the_whole_text(tiny_dir, write_jsonl, tokenizer, rows):
    eos = tokenizer.eos_token_id
    # the shipped tokenizer merges across these splits: tokenizing the parts apart gives other tokens
    assert tokenizer("Q: who?\nTh")["input_ids"] + tokenizer("e cat", add_special_tokens=False)["input_ids"] \
        != tokenizer("Q: who?\nThe cat")["input_ids"]
    for raw, row in zip(rows, _rows(write_jsonl(rows), tiny_dir, max_prompt_length=None)):
        prompt = raw.get("prompt", "")
        for key in ("chosen", "rejected"):
            whole = tokenizer(prompt + raw[key])["input_ids"] + [eos]
            assert row["prompt_input_ids"] + row[f"{key}_input_ids"] == whole, (raw, key)
            assert len(row[f"{key}_input_ids"]) >= 2  # never EOS alone
        assert row["prompt_input_ids"]


def test_conversational_sequences_are_the_tokenizers_own_output(tiny_dir, data_dir, tokenizer):
    import json

    raws = [json.loads(line) for line in (data_dir / "chat_preference.jsonl").read_text().splitlines()[:4]]
    for raw, row in zip(raws, _rows(data_dir / "chat_preference.jsonl", tiny_dir, max_prompt_length=None)):
        for key in ("chosen", "rejected"):
            text = tokenizer.apply_chat_template(raw["prompt"] + raw[key], tokenize=False)
            whole = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert row["prompt_input_ids"] + row[f"{key}_input_ids"] == whole


def test_default_truncation_keeps_the_prompt_and_cuts_the_completions_ends(tiny_dir, write_jsonl, tokenizer):
    rows = [{"prompt": "1 2 3 4 5 6 7 8 =", "chosen": " 9" * 10, "rejected": " 8" * 10}]
    prompt = tokenizer(rows[0]["prompt"])["input_ids"]
    row = _rows(write_jsonl(rows), tiny_dir, max_length=24)[0]
    assert row["prompt_input_ids"] == prompt  # the whole prompt: every kept token sees its real context
    assert len(row["chosen_input_ids"]) == len(row["rejected_input_ids"]) == 24 - len(prompt)
    assert row["chosen_input_ids"] == tokenizer(" 9" * 10, add_special_tokens=False)["input_ids"][:24 - len(prompt)]
    # keep_end keeps the completions whole and the prompt's end instead
    end = _rows(write_jsonl(rows), tiny_dir, max_length=30, truncation_mode="keep_end")[0]
    completion = tokenizer(" 9" * 10, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert end["chosen_input_ids"] == completion
    assert 0 < len(end["prompt_input_ids"]) == 30 - len(completion) < len(prompt)
    assert end["prompt_input_ids"] == prompt[len(prompt) - (30 - len(completion)):]
