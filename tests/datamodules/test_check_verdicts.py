"""A second run on the same data and settings skips the file check and the row validation (``check_verdicts``);
a changed file, changed settings or a changed chat template are checked again, and failures are never recorded.

Mutations (each makes a test here fail): ``file_key`` without ``mtime_ns`` -> ``test_file_verdict_follows_size_and_mtime``
(same size, new time); without ``size`` -> the same test (new size, old time); ``passed`` recording before ``check()``
ran (a failure recorded) -> ``test_failures_are_checked_every_time``; ``rows_key`` without ``settings`` ->
``test_changed_settings_are_validated_again`` (each case); without ``fingerprint`` ->
``test_edited_rows_are_validated_again``; ``_read`` ignoring ``LIGHTALIGN_PROBE_CACHE=0`` ->
``test_second_setup_skips_both_checks``; the unpaired or prompt datamodule calling ``validate`` without
``validate_once`` -> ``test_other_datamodules_skip_validation_of_unchanged_rows``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import lightalign.datamodules.sources as sources
from lightalign.datamodules import SFTDataModule
from lightalign.datamodules.formats import DataFormatError

TINY = str(Path(__file__).resolve().parents[2] / "assets" / "models" / "tiny")
ROWS = [{"prompt": "What is two plus two?", "completion": " four"},
        {"prompt": "Name a colour.", "completion": " blue"},
        {"prompt": "Say hi.", "completion": " hi"}]
CHAT = [{"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}]},
        {"messages": [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye"}]}]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Verdicts of this test only (the suite's cache is shared by every test of a run)."""
    monkeypatch.setenv("LIGHTALIGN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LIGHTALIGN_PROBE_CACHE", raising=False)


@pytest.fixture
def counts(monkeypatch):
    """How often the file check (``_check_json``) and the row validation (``SFTDataModule.validate``) ran."""
    seen = {"file": 0, "rows": 0}
    check_json, validate = sources._check_json, SFTDataModule.validate

    def counted_check(*args, **kwargs):
        seen["file"] += 1
        return check_json(*args, **kwargs)

    def counted_validate(*args, **kwargs):
        seen["rows"] += 1
        return validate(*args, **kwargs)

    monkeypatch.setattr(sources, "_check_json", counted_check)
    monkeypatch.setattr(SFTDataModule, "validate", counted_validate)
    return seen


def write(path: Path, rows: list[dict], mtime_ns: int | None = None) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return str(path)


def setup(path: str, **kw) -> SFTDataModule:
    dm = SFTDataModule(path, kw.pop("tokenizer", TINY), max_length=64, **kw)
    dm.setup("fit")
    return dm


def test_second_setup_skips_both_checks(tmp_path, counts, monkeypatch):
    path = write(tmp_path / "data.jsonl", ROWS)
    first = setup(path)
    assert counts == {"file": 1, "rows": 1}
    second = setup(path)
    assert counts == {"file": 1, "rows": 1}  # both verdicts reused
    assert second.train_dataset[:] == first.train_dataset[:]
    monkeypatch.setenv("LIGHTALIGN_PROBE_CACHE", "0")  # the documented switch: nothing read from disk
    setup(path)
    assert counts == {"file": 2, "rows": 2}


def test_file_verdict_follows_size_and_mtime(tmp_path, counts):
    path = tmp_path / "data.jsonl"
    write(path, ROWS)
    stat = path.stat()
    assert sources.check_file(path, str(path)) == ["prompt", "completion"]
    assert sources.check_file(path, str(path)) == ["prompt", "completion"] and counts["file"] == 1
    # the same size, a new modification time: a line cut short (its closing brace moved to the end of the file)
    text = path.read_text()
    cut = text.replace(' blue"}\n', ' blue"\n', 1) + "}"
    assert len(cut) == len(text)
    path.write_text(cut)
    os.utime(path, ns=(stat.st_mtime_ns + 10**9, stat.st_mtime_ns + 10**9))
    with pytest.raises(DataFormatError, match=r"line 2, column \d+: invalid JSON"):
        sources.check_file(path, str(path))
    # a new size, the old modification time
    path.write_text(text.replace(' blue"}', ' blue", "prompt": "again"}', 1))
    os.utime(path, ns=(stat.st_mtime_ns, stat.st_mtime_ns))
    assert path.stat().st_size != stat.st_size
    with pytest.raises(DataFormatError, match="line 2: the key 'prompt' appears twice"):
        sources.check_file(path, str(path))


def test_edited_rows_are_validated_again(tmp_path, counts):
    path = tmp_path / "data.jsonl"
    write(path, ROWS)
    setup(path)
    old = path.stat().st_mtime_ns
    blank = [*ROWS[:1], {**ROWS[1], "completion": " " * len(ROWS[1]["completion"])}, *ROWS[2:]]
    write(path, blank, mtime_ns=old + 10**9)  # the same size, a new time: datasets reads the file again
    with pytest.raises(DataFormatError, match=re.escape("line 2: row 1, column 'completion': the text is empty")):
        setup(str(path))
    assert counts == {"file": 2, "rows": 2}


def test_failures_are_checked_every_time(tmp_path, counts):
    path = write(tmp_path / "data.jsonl", [*ROWS, {"prompt": "Empty?", "completion": ""}])
    for attempt in (1, 2):
        with pytest.raises(DataFormatError, match="row 3, column 'completion': the text is empty"):
            setup(path)
        assert counts == {"file": 1, "rows": attempt}  # the file itself passed; the rows fail each time
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a",\n')
    for attempt in (1, 2):
        with pytest.raises(DataFormatError, match="line 2, column 16: invalid JSON"):
            sources.check_file(bad, str(bad))
        assert counts["file"] == 1 + attempt


TEMPLATE = Path(TINY, "chat_template.jinja").read_text()
NO_MARKERS = re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", TEMPLATE)


@pytest.mark.parametrize("rows, passes, fails, error", [
    # the text column: 'body' holds an empty text
    ([{"text": "a story", "body": "one"}, {"text": "another", "body": " "}],
     {"dataset_text_field": "text"}, {"dataset_text_field": "body"}, "row 1, column 'body': the text is empty"),
    # the loss mask: assistant turns required
    ([CHAT[0], {"messages": [{"role": "user", "content": "Anyone?"}, {"role": "system", "content": "no"}]}],
     {}, {"assistant_only_loss": True}, "row 1, column 'messages': the conversation has no assistant turn"),
    # the chat template: the assistant-turn markers assistant_only_loss needs
    (CHAT, {"assistant_only_loss": True}, {"assistant_only_loss": True, "chat_template": NO_MARKERS},
     "needs a chat template that marks assistant turns"),
], ids=["dataset_text_field", "assistant_only_loss", "chat_template"])
def test_changed_settings_are_validated_again(tmp_path, counts, rows, passes, fails, error):
    path = write(tmp_path / "data.jsonl", rows)
    setup(path, **passes)
    setup(path, **passes)
    assert counts["rows"] == 1
    with pytest.raises(DataFormatError, match=re.escape(error)):
        setup(path, **fails)
    assert counts["rows"] == 2


@pytest.mark.parametrize("module, rows, column", [
    ("UnpairedPreferenceDataModule", [{**row, "label": i % 2 == 0} for i, row in enumerate(ROWS)], "completion"),
    ("PromptDataModule", [{"prompt": row["prompt"]} for row in ROWS], "prompt"),
])
def test_other_datamodules_skip_validation_of_unchanged_rows(tmp_path, monkeypatch, module, rows, column):
    import lightalign.datamodules as datamodules

    cls, calls = getattr(datamodules, module), []
    validate = cls.validate
    monkeypatch.setattr(cls, "validate", lambda self, *a, **k: calls.append(1) or validate(self, *a, **k))
    path = tmp_path / "data.jsonl"
    write(path, rows)
    for _ in range(2):
        cls(str(path), TINY, batch_size=2).setup("fit")
    assert len(calls) == 1
    blank = [*rows[:1], {**rows[1], column: " " * len(rows[1][column])}, *rows[2:]]
    write(path, blank, mtime_ns=path.stat().st_mtime_ns + 10**9)
    with pytest.raises(DataFormatError, match=re.escape(f"row 1, column '{column}': the text is empty")):
        cls(str(path), TINY, batch_size=2).setup("fit")
    assert len(calls) == 2
