"""Data files as editors write them (#48): an invalid-JSON error names the line and column where the JSON goes
wrong, also when a line or the document is cut short (``sources._error_position``).

The console tests run the venv's ``lightalign`` script and check the exit status and the one-line error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import console_script

from lightalign import DataFormatError

ROWS = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(6)]


def file_text(kind: str, rows: list[dict]) -> str:
    """``rows`` as a JSON array (two lines per row after the ``[``), JSON lines, or CSV (a header, one line per row)."""
    if kind == "json":
        return "[\n" + ",\n".join(f'  {{"prompt": {json.dumps(r["prompt"])},\n   "completion": '
                                  f'{json.dumps(r["completion"])}}}' for r in rows) + "\n]\n"
    if kind == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in rows)
    return "prompt,completion\n" + "".join(f"{r['prompt']},{r['completion']}\n" for r in rows)


def write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode())
    return path


# --------------------------------------------------------------------------------------------- invalid JSON
CUT = '{"prompt": "What is 2+2?", "answer":'  # 36 characters: the value is missing at column 37


@pytest.mark.parametrize("name, text, line, column", [
    ("cut.jsonl", f'{{"text": "a"}}\n{CUT}\n{{"text": "c"}}\n', 2, 37),
    ("crlf.jsonl", f'{{"text": "a"}}\r\n{CUT}\r\n', 2, 37),
    ("last.jsonl", f'{{"text": "a"}}\n{CUT}', 2, 37),
    ("middle.jsonl", '{"text": "a"}\n{"text": "b" "c": 1}\n', 2, 14),
    ("cut.json", f'[\n  {{"text": "a"}},\n  {CUT}\n\n', 3, 39),
    ("middle.json", '[\n  {"text": "a"},\n  {"text" "b"}\n]\n', 3, 11),
    ("unclosed.json", '[\n  {"text": "a"},\n  {"text": "b"}\n', 3, 16),
])
def test_invalid_json_names_the_line_and_column_where_it_goes_wrong(tmp_path, name, text, line, column):
    """A value cut short is placed just past the line's last character: ``json`` puts it after the newline, at
    column 1 of the next line, which the JSON-lines error reported as column 1 of the cut line (mutation:
    ``_error_position`` returning ``err.lineno, err.colno`` -> every case cut before a newline fails; a last line
    without one was right already). An error inside a line keeps ``json``'s own line and column."""
    from lightalign.datamodules.sources import check_file

    path = write(tmp_path / name, text)
    with pytest.raises(DataFormatError, match=rf"Data file '.*{name}', line {line}, column {column}: invalid JSON \("):
        check_file(path, str(path))


# --------------------------------------------------------------------------------------------- console
def console_error_line(repo: Path, *args: str) -> str:
    out = console_script.expect(repo, *args, status=1)
    lines = [line for line in out.splitlines() if line.startswith("lightalign: error:")]
    assert len(lines) == 1 and "Traceback" not in out and "Tokenizing" not in out, out[-4000:]
    return lines[0]


@pytest.mark.slow
def test_console_names_the_column_of_invalid_json(repo, tmp_path):
    """Through the console script (exit 1, one line, before tokenizing): the cut line is named with its line and
    column."""
    path = write(tmp_path / "cut.jsonl", file_text("jsonl", ROWS[:1]) + CUT + "\n")
    expected = f"Data file '{path}', line 2, column 37: invalid JSON (Expecting value)."
    line = console_error_line(repo, "fit", "--config", "configs/quickstart.yaml", "--data.path", str(path),
                              "--data.val_path", "null", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"))
    assert line.startswith("lightalign: error: ") and expected in line, line
