"""Data files as editors write them (#48): a UTF-8 byte order mark (BOM) is skipped in json, jsonl and csv files
alike (``sources._decode``), and an invalid-JSON error names the line and column where the JSON goes wrong, also
when a line or the document is cut short (``sources._error_position``).

The console tests run the venv's ``lightalign`` script and check the exit status and the one-line error.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import pytest

from helpers import console_script

from lightalign import DataFormatError, SFTDataModule

ROWS = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(6)]


def file_text(kind: str, rows: list[dict]) -> str:
    """``rows`` as a JSON array (two lines per row after the ``[``), JSON lines, or CSV (a header, one line per row)."""
    if kind == "json":
        return "[\n" + ",\n".join(f'  {{"prompt": {json.dumps(r["prompt"])},\n   "completion": '
                                  f'{json.dumps(r["completion"])}}}' for r in rows) + "\n]\n"
    if kind == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in rows)
    return "prompt,completion\n" + "".join(f"{r['prompt']},{r['completion']}\n" for r in rows)


def write(path: Path, text: str, bom: bool = False) -> Path:
    path.write_bytes((codecs.BOM_UTF8 if bom else b"") + text.encode())
    return path


def setup_sft(path: Path, tiny_dir: Path) -> SFTDataModule:
    dm = SFTDataModule(str(path), tokenizer=str(tiny_dir))
    dm.setup("fit")
    return dm


# --------------------------------------------------------------------------------------------- byte order marks
@pytest.mark.parametrize("kind", ["json", "jsonl", "csv"])
def test_a_byte_order_mark_is_skipped_in_every_format(tiny_dir, tmp_path, kind):
    """The same tokenized rows with and without a BOM (mutation: the BOM kept by ``_decode`` -> the json file fails
    with "Expecting value", the jsonl file with "Unexpected UTF-8 BOM"; csv was accepted before)."""
    text = file_text(kind, ROWS)
    plain = setup_sft(write(tmp_path / f"plain.{kind}", text), tiny_dir)
    marked = setup_sft(write(tmp_path / f"marked.{kind}", text, bom=True), tiny_dir)
    assert marked.train_dataset.to_dict() == plain.train_dataset.to_dict()


@pytest.mark.parametrize("kind, line", [("json", 8), ("jsonl", 4), ("csv", 5)])
def test_rows_of_a_file_with_a_byte_order_mark_are_named_by_their_line(tiny_dir, tmp_path, kind, line):
    """Row 3's completion is empty: the error names the line the row starts at, counted as without the BOM."""
    rows = [dict(r) for r in ROWS]
    rows[3]["completion"] = " "
    path = write(tmp_path / f"marked.{kind}", file_text(kind, rows), bom=True)
    with pytest.raises(DataFormatError, match=rf"marked.{kind}', line {line}: row 3, column 'completion': the text is "
                                              r"empty"):
        setup_sft(path, tiny_dir)


def test_a_folder_of_csv_files_with_and_without_a_byte_order_mark_loads(tiny_dir, tmp_path):
    """The header's first name is read without the BOM, so both files have the columns prompt and completion
    (mutation: the header read as plain UTF-8 -> "file 'b.csv' has columns ['completion', 'prompt'] but 'a.csv' has
    ['\\ufeffprompt', 'completion']")."""
    folder = tmp_path / "data"
    folder.mkdir()
    # words, not numbers: a folder's CSV cells are not cast to text as a single CSV file's are
    rows = [{"prompt": f"{i}+1 is", "completion": f" {i + 1} units"} for i in range(6)]
    write(folder / "a.csv", file_text("csv", rows[:3]), bom=True)
    write(folder / "b.csv", file_text("csv", rows[3:]))
    assert len(setup_sft(folder, tiny_dir).train_dataset) == 6


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
console_error_line = console_script.data_refusal


@pytest.mark.slow
@pytest.mark.parametrize("case", ["json array with a BOM", "jsonl with a BOM", "jsonl line cut short"])
def test_console_reads_bom_files_and_names_the_column_of_invalid_json(repo, tmp_path, case):
    """Through the console script (exit 1, one line, before tokenizing): the BOM files are read, so the error is
    their row 3's (an empty completion) at its line; the cut line is named with its line and column."""
    rows = [dict(r) for r in ROWS]
    rows[3]["completion"] = " "
    if case == "jsonl line cut short":
        path = write(tmp_path / "cut.jsonl", file_text("jsonl", ROWS[:1]) + CUT + "\n")
        expected = f"Data file '{path}', line 2, column 37: invalid JSON (Expecting value)."
    else:
        kind = "json" if case.startswith("json array") else "jsonl"
        path = write(tmp_path / f"marked.{kind}", file_text(kind, rows), bom=True)
        expected = f"line {8 if kind == 'json' else 4}: row 3, column 'completion': the text is empty."
    line = console_error_line(repo, "fit", "--config", "configs/quickstart.yaml", "--data.path", str(path),
                              "--data.val_path", "null", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"))
    assert line.startswith("lightalign: error: ") and expected in line, line


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_contents_mixing_strings_and_parts_read_back_as_the_file_holds_them(tmp_path, suffix):
    """A conversation column whose contents mix strings and content-part lists (TRL's image conversations) keeps
    every string exactly (``sources._with_content_parts``: strings become one text part). Mutation: returning the
    dataset as ``datasets`` read it -> the answer "4" comes back as the number 4 and "null" as None."""
    from lightalign.datamodules.sources import load_rows

    answers = ["4", "null", "1e3", '"quoted"', "true"]
    rows = [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]},
                          {"role": "assistant", "content": a}]} for a in answers]
    path = tmp_path / f"mixed{suffix}"
    path.write_text(json.dumps(rows) if suffix == ".json" else "\n".join(json.dumps(r) for r in rows) + "\n")
    got = load_rows(str(path))
    assert [r["messages"][1]["content"] for r in got] == [[{"type": "text", "text": a}] for a in answers]
    assert got[0]["messages"][0]["content"] == rows[0]["messages"][0]["content"]
