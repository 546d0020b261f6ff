"""Bad preference data and DPO knobs: each gets a clear error naming the row, the column or the key."""

from __future__ import annotations

import pytest

from lightalign import DataFormatError, DPOModule, PreferenceDataModule


def _data(path, tiny_dir, **kw):
    dm = PreferenceDataModule(str(path), tokenizer=str(tiny_dir), **kw)
    dm.setup("fit")
    return dm


def test_unknown_loss_type_and_bad_knobs_rejected_at_construction():
    with pytest.raises(ValueError, match=r"Unknown DPO loss_type 'kto'.*'sigmoid'.*'discopop'"):
        DPOModule("m", loss_type="kto")
    with pytest.raises(ValueError, match="beta must be > 0"):
        DPOModule("m", beta=0.0)
    with pytest.raises(ValueError, match=r"label_smoothing must lie in \[0.0, 0.5\)"):
        DPOModule("m", label_smoothing=0.5)
    with pytest.raises(ValueError, match="loss_weights has 1"):
        DPOModule("m", loss_type=["sigmoid", "sft"], loss_weights=[1.0])


def test_missing_rejected_column(tiny_dir, write_jsonl):
    with pytest.raises(DataFormatError, match=r"needs 'chosen' and 'rejected'.*lacks \['rejected'\]"):
        _data(write_jsonl([{"prompt": "1+1=", "chosen": "2"}]), tiny_dir)


def test_implicit_rows_without_shared_prefix(tiny_dir, write_jsonl):
    rows = [{"chosen": "a b", "rejected": "a c"}, {"chosen": "yes", "rejected": "no"}]
    with pytest.raises(DataFormatError, match="row 1: 'chosen' and 'rejected' share no prefix"):
        _data(write_jsonl(rows), tiny_dir)


def test_identical_pairs_warn_with_count(tiny_dir, write_jsonl):
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "2"}, {"prompt": "1+2=", "chosen": "3", "rejected": "4"},
            {"prompt": "2+2=", "chosen": "4", "rejected": "4"}]
    with pytest.warns(UserWarning, match=r"2 of 3 train rows have identical 'chosen' and 'rejected' \(the first: row 0\)"):
        _data(write_jsonl(rows), tiny_dir)


def test_every_pair_identical_is_refused_through_the_console_script(repo, tmp_path):
    """Nothing to learn: refused at data load in one line naming the count and the first row (the file's line
    numbering, 0-based). Mutation: the refusal removed -> DPO trains with exit 0."""
    import json

    from helpers import console_script

    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 1)} for i in range(40)]
    data = tmp_path / "same.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = console_script.run(repo, "fit", "--config", "configs/dpo_tiny.yaml", "--data.path", str(data),
                              "--data.val_split_size", "0", "--trainer.max_steps", "2",
                              "--trainer.logger.init_args.save_dir", str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("lightalign: error:"))
    assert line.startswith(f"lightalign: error: train data '{data}': Every one of the 40 train rows has identical 'chosen' and 'rejected' "
                           "(the first: row 0): there is no preference to learn"), line


def test_prompt_leaves_nothing_for_completion(tiny_dir, write_jsonl):
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "9" * 40, "chosen": "2", "rejected": "3"}]
    with pytest.raises(DataFormatError, match=r"row 1: the prompt has 40 tokens and nothing is left of the chosen"):
        _data(write_jsonl(rows), tiny_dir, max_length=16, max_prompt_length=None, truncation_mode="keep_start")


def test_mixed_standard_and_conversational_rows(tiny_dir, write_jsonl):
    rows = [{"prompt": "one plus one", "chosen": "two", "rejected": "three"},
            {"prompt": [{"role": "user", "content": "1+1?"}], "chosen": [{"role": "assistant", "content": "2"}],
             "rejected": [{"role": "assistant", "content": "3"}]}]
    # refused while reading the file: a column holds one JSON type (a list among strings names its line)
    with pytest.raises(DataFormatError, match=r"line 2 \(lines counted from 1\): column 'prompt' holds a list"):
        _data(write_jsonl(rows), tiny_dir)
