"""Every bad input gets a clear error, raised before the model is loaded when the data alone decides."""

from __future__ import annotations

import lightning as L
import pytest

from lightalign import DataFormatError, ModelNotFoundError, SFTDataModule, SFTModule
from lightalign.hub import load_causal_lm, load_tokenizer


def _setup(path, tiny_dir, **kw):
    dm = SFTDataModule(path, tokenizer=str(tiny_dir), **kw)
    dm.setup("fit")
    return dm


def test_missing_file(tiny_dir, tmp_path):
    with pytest.raises(DataFormatError, match=r"Data file '.*nope.jsonl' does not exist"):
        _setup(str(tmp_path / "nope.jsonl"), tiny_dir)


def test_unknown_format_lists_columns_and_formats(tiny_dir, write_jsonl):
    with pytest.raises(DataFormatError, match=r"found columns \['answer', 'question'\].*expected one of.*'messages'"):
        _setup(write_jsonl([{"question": "a", "answer": "b"}]), tiny_dir)


def test_preference_data_is_rejected_for_sft(tiny_dir, data_dir):
    with pytest.raises(DataFormatError, match="SFT cannot train on preference data"):
        _setup(str(data_dir / "arithmetic_preference.jsonl"), tiny_dir)


def test_empty_file_and_empty_split(tiny_dir, tmp_path, write_jsonl):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataFormatError, match="is empty"):
        _setup(str(empty), tiny_dir)
    from datasets import Dataset

    with pytest.raises(DataFormatError, match="empty"):
        _setup(Dataset.from_dict({"text": []}), tiny_dir)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}], r"line 2 \(lines counted from 1\): column 'messages' \(at messages\[\]\.content\) holds a number 5"),
        ([{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}], r"row 1, column 'messages', message 0 \(user\): content is empty"),
        ([{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}], r"row 1, column 'messages', message 0: unknown role 'wizard'"),
    ],
)
def test_bad_message_rows_name_the_row(tiny_dir, write_jsonl, messages, match):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    with pytest.raises(DataFormatError, match=match):
        _setup(write_jsonl([good, {"messages": messages}]), tiny_dir)


def test_no_assistant_turn_with_assistant_only_loss(tiny_dir, write_jsonl):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(DataFormatError, match="row 2, column 'messages': the conversation has no assistant turn"):
        _setup(write_jsonl([good, good, bad]), tiny_dir, assistant_only_loss=True)
    # without assistant_only_loss the same row is fine
    _setup(write_jsonl([good, good, bad]), tiny_dir)


def test_bad_prompt_completion_row(tiny_dir, write_jsonl):
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": ""}]
    with pytest.raises(DataFormatError, match="row 1, column 'completion': the text is empty"):
        _setup(write_jsonl(rows), tiny_dir)


def test_every_row_too_long_says_how_many(tiny_dir, write_jsonl):
    rows = [{"prompt": "9" * 50, "completion": "1"} for _ in range(4)]
    with pytest.raises(DataFormatError, match=r"all 4 rows lost their targets \(4 of them are longer than max_length=8"):
        _setup(write_jsonl(rows), tiny_dir, max_length=8)


def test_tokenizer_without_chat_template(tiny_dir, tmp_path, write_jsonl):
    tok = load_tokenizer(str(tiny_dir))
    tok.chat_template = None
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    dm = SFTDataModule(write_jsonl(rows), tokenizer=tok)
    with pytest.raises(DataFormatError, match="has no chat template"):
        dm.setup("fit")


def test_assistant_only_loss_needs_generation_markers(tiny_dir, write_jsonl):
    tok = load_tokenizer(str(tiny_dir))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    dm = SFTDataModule(write_jsonl(rows), tokenizer=tok, assistant_only_loss=True)
    with pytest.raises(DataFormatError, match="generation"):
        dm.setup("fit")


def test_unknown_model_offline_says_hub_unreachable(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match=r"not a local folder.*HF_HUB_OFFLINE is set.*local folder"):
        load_tokenizer("some-org/some-model-that-is-not-here")
    with pytest.raises(ModelNotFoundError, match="not a local folder"):
        load_causal_lm("some-org/some-model-that-is-not-here")


def test_missing_local_model_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_causal_lm(str(tmp_path / "missing"))


def test_data_error_raised_before_model_loads(tiny_dir, write_jsonl, monkeypatch):
    """fit() fails on the bad row in datamodule.setup, before configure_model builds the model."""
    import lightalign.modules.training.model_building as base

    calls = []
    monkeypatch.setattr(base, "load_causal_lm", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(AssertionError))
    bad = write_jsonl([{"messages": [{"role": "user", "content": 3}]}])
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(DataFormatError, match="row 0"):
        trainer.fit(SFTModule(str(tiny_dir), from_config=True), SFTDataModule(bad, tokenizer=str(tiny_dir)))
    assert calls == []


def test_config_errors_at_construction():
    with pytest.raises(ValueError, match="truncation_mode='middle'"):
        SFTDataModule("x.jsonl", tokenizer="t", truncation_mode="middle")
    with pytest.raises(ValueError, match="packing needs max_length"):
        SFTDataModule("x.jsonl", tokenizer="t", packing=True, max_length=None)
    with pytest.raises(ValueError, match="lr_scheduler_type='warp'"):
        SFTModule("m", lr_scheduler_type="warp")


def test_model_with_remote_code_needs_explicit_trust(tmp_path, tiny_dir):
    import json
    import shutil

    folder = tmp_path / "custom"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="my_custom_lm", auto_map={"AutoConfig": "modeling_custom.CustomConfig",
                                                         "AutoModelForCausalLM": "modeling_custom.CustomLM"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_custom.py").write_text("raise RuntimeError('remote code must not run')\n")
    with pytest.raises(ValueError, match=r"ships its own Python code.*trust_remote_code: true"):
        load_causal_lm(str(folder), from_config=True)
