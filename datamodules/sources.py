"""Where rows come from: a ``Dataset``, a local json/jsonl/parquet/csv/arrow file or folder, or a hub dataset name.

Local text files are checked before ``datasets`` reads them, so a bad file fails naming the file and the line
(``datasets`` would say "An error occurred while generating the dataset", or keep the last of two equal keys, or
rename a second CSV column ``a`` to ``a.1``):

* every byte is UTF-8 (the error gives the byte offset and the line of the first bad byte); a UTF-8 byte order mark
  (BOM: ``EF BB BF``, which Windows editors write) starting a json, jsonl or csv file is skipped, as ``datasets``
  skips it when it reads the file;
* json/jsonl: every line (or the whole document) parses (an error names its line and column, ``_error_position``),
  no object repeats a key, at any depth, and every column (and every field inside one, e.g. ``messages[].content``)
  holds one JSON type: ``datasets`` casts a column to one type, so a ``2`` among strings like ``"60"`` would turn
  the whole column into numbers and an error after loading would name a row that was fine (``ColumnTypes``);
* csv: no two header columns share a name;
* a folder's files all have the same columns.

A file that passed is not read again while its path, size and modification time stay the same
(``check_verdicts``: the facts ``datasets`` reuses its own cache of the file by).

A path that looks local (it exists, starts with ``.``, ``/`` or ``~``, or ends in a file extension) is never sent
to the hub; a folder must hold one kind of supported file (mixed folders are refused, naming the files).
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightalign.datamodules.check_verdicts import file_key, passed
from lightalign.datamodules.column_types import ColumnTypes
from lightalign.datamodules.formats import DataFormatError

if TYPE_CHECKING:  # datasets (with pandas, pyarrow) is imported where rows are read, not for --help
    from datasets import Dataset

# What ``path``/``val_path``/``test_path`` take: a local path, a hub name or a ``Dataset``. Typed ``Any`` for the CLI:
# jsonargparse reads a file named for an argument whose type includes a class (``Dataset``) as the argument's value,
# so an empty data file became None ("needs `path`") and a CSV file's path its text.
DataSource = Any

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
# Extensions that mark a path as a local file even when it does not exist (a hub name has none of these).
_OTHER_FILE_EXTENSIONS = {
    ".txt", ".text", ".tsv", ".ndjson", ".jsonlines", ".xlsx", ".xls", ".yaml", ".yml", ".md", ".xml", ".html",
    ".pkl", ".pickle", ".npy", ".npz", ".feather", ".pq", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".jinja",
}


def load_rows(source: str | Dataset, split: str = "train", name: str | None = None) -> Dataset:
    """Load one split from a ``Dataset``, a local json/jsonl/parquet/csv/arrow file or folder, or a hub name."""
    if isinstance(source, (str, Path)):  # checked before datasets is imported (a bad file is refused without it)
        dataset = _load_path_or_hub(str(source), split, name)
    else:
        from datasets import Dataset, DatasetDict

        if isinstance(source, Dataset):
            dataset = source
        elif isinstance(source, DatasetDict):
            if split not in source:
                raise DataFormatError(f"The DatasetDict has no split '{split}'; it has {sorted(source)}.")
            dataset = source[split]
        else:
            dataset = _load_path_or_hub(str(source), split, name)
    if len(dataset) == 0:
        raise DataFormatError(f"Dataset '{describe(source)}' (split '{split}') is empty: it has no rows.")
    return dataset


def describe(source: Any) -> str:
    return str(source) if isinstance(source, (str, Path)) else type(source).__name__


def looks_local(source: str) -> bool:
    """A path on this machine rather than a hub dataset name (``org/name``)."""
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    return (source.startswith((".", "/", "~")) or path.exists() or suffix in FILE_BUILDERS
            or suffix in _OTHER_FILE_EXTENSIONS)


def _load_path_or_hub(source: str, split: str, name: str | None) -> Dataset:
    from datasets import load_dataset

    path = Path(source).expanduser()
    if not looks_local(source):
        return _load_hub(source, split, name)
    if not path.exists():
        raise DataFormatError(f"Data file '{source}' does not exist (looked at '{path.resolve()}').")
    if path.is_dir():
        check_folder(path, source)
        with _quiet_json_builder():
            return load_dataset(str(path), name=name, split=split)
    suffix = path.suffix.lower()
    if suffix not in FILE_BUILDERS:
        raise DataFormatError(
            f"Data file '{source}' has an unsupported extension '{suffix}'; use one of {sorted(FILE_BUILDERS)} "
            "(e.g. one JSON object per line in a .jsonl file)."
        )
    if path.stat().st_size == 0:
        raise DataFormatError(f"Data file '{source}' is empty (0 bytes).")
    check_file(path, source)
    with _quiet_json_builder():
        try:
            dataset = load_dataset(FILE_BUILDERS[suffix], data_files=str(path), split="train")
        except Exception as err:  # the checks above passed, so this is something they do not cover
            if type(err).__name__ != "DatasetGenerationError":
                raise
            cause = err.__cause__ or err.__context__
            raise DataFormatError(f"Data file '{source}' could not be read: {type(cause).__name__}: {cause}") from err
    if FILE_BUILDERS[suffix] == "json":
        dataset = _with_content_parts(dataset, path)
    if suffix == ".csv":  # CSV cells are text; pandas would turn "19" into 19
        from datasets import Features, Value

        dataset = dataset.cast(Features({c: Value("string") for c in dataset.column_names}))
    return dataset


def _with_content_parts(dataset: Dataset, path: Path) -> Dataset:
    """A conversation column whose ``content`` mixes strings and lists of content parts (TRL's image conversations:
    parts in the user turn, a string answer) is what ``datasets`` stores as a ``Json`` value, and it reads back a
    string that parses as JSON as that value (the answer ``"4"`` as the number 4, ``"null"`` as None). Such columns
    are read again from the file as TRL's ``prepare_multimodal_messages`` makes them (``as_content_parts``: every
    string content one text part, the row's images placed before the first user turn's text when the conversation
    has no image parts), so each content holds exactly what the file did."""
    from datasets.features import Json

    columns = [name for name, feature in dataset.features.items()
               if isinstance(getattr(feature, "feature", None), dict)
               and isinstance(feature.feature.get("content"), Json)]
    if not columns:
        return dataset
    text = path.read_text(encoding="utf-8-sig")
    rows: Any = None
    if path.suffix.lower() == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError:  # JSON lines in a .json file (check_file accepted them)
            rows = None
        rows = [rows] if isinstance(rows, dict) else rows
    if rows is None:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]

    from lightalign.vision.images import row_image_values
    from lightalign.vision.messages import as_content_parts

    values = {name: [as_content_parts(row.get(name), len(row_image_values(row))) for row in rows] for name in columns}
    return dataset.map(lambda _, i: {f"{name}__parts": values[name][i] for name in columns}, with_indices=True,
                       remove_columns=columns, load_from_cache_file=False,
                       ).rename_columns({f"{name}__parts": name for name in columns})


def _load_hub(source: str, split: str, name: str | None) -> Dataset:
    from datasets import load_dataset

    try:
        return load_dataset(source, name=name, split=split)
    except ValueError as err:
        if "split" in str(err).lower():
            raise DataFormatError(f"Dataset '{source}' has no split '{split}': {err}") from err
        raise
    except Exception as err:  # connection errors, DatasetNotFoundError, ...
        raise DataFormatError(
            f"Could not load dataset '{source}': it is not a local file or folder, and the Hugging Face hub "
            f"could not provide it ({type(err).__name__}: {err}). Pass a local json/jsonl/parquet/csv file, e.g. "
            "--data.path data/train.jsonl."
        ) from err


@contextmanager
def _quiet_json_builder():
    """datasets' json builder logs its own error before raising; ours replaces it."""
    logger = logging.getLogger("datasets.packaged_modules.json.json")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


# --------------------------------------------------------------------------------------------- folders
def check_folder(path: Path, source: str) -> None:
    """A folder loads as one dataset: it must hold data files of one kind (json/jsonl count as one)."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    data = [p for p in files if p.suffix.lower() in FILE_BUILDERS]
    if not data:
        found = sorted({p.suffix.lower() or p.name for p in files})
        raise DataFormatError(
            f"Data folder '{source}' holds no {'/'.join(sorted(FILE_BUILDERS))} file (found: {found or 'nothing'})."
        )
    kinds: dict[str, list[str]] = {}
    for p in data:
        kinds.setdefault(FILE_BUILDERS[p.suffix.lower()], []).append(str(p.relative_to(path)))
    if len(kinds) > 1:
        listing = "; ".join(f"{kind}: {', '.join(names[:3])}{' …' if len(names) > 3 else ''}"
                            for kind, names in sorted(kinds.items()))
        raise DataFormatError(
            f"Data folder '{source}' mixes file formats ({listing}); only one kind would be loaded. Convert them to "
            "one format, or move the others out of the folder."
        )
    first: tuple[Path, list[str]] | None = None
    for p in data:
        if p.stat().st_size and FILE_BUILDERS[p.suffix.lower()] in ("json", "csv"):
            columns = check_file(p, str(p))
            if first is None:
                first = (p, columns)
            elif set(columns) != set(first[1]):
                only_first, only_here = sorted(set(first[1]) - set(columns)), sorted(set(columns) - set(first[1]))
                raise DataFormatError(
                    f"Data folder '{source}': file '{p.relative_to(path)}' has columns {sorted(columns)} but "
                    f"'{first[0].relative_to(path)}' has {sorted(first[1])} (only in the first: {only_first}; only in "
                    f"the second: {only_here}); a folder loads as one dataset, so its files need the same columns."
                )


# --------------------------------------------------------------------------------------------- files
def check_file(path: Path, source: str) -> list[str]:
    """UTF-8 throughout; JSON that parses without repeated keys, one type per column; CSV headers without repeated
    names. Returns the file's columns (json, csv; [] otherwise). A file that passed before, unchanged since (same
    path, size and modification time), is not read again (``check_verdicts``)."""
    kind = FILE_BUILDERS.get(path.suffix.lower())
    if kind == "json":
        return passed("file", file_key(path), lambda: _check_json(path, source))
    if kind == "csv":
        return passed("file", file_key(path), lambda: _check_csv(path, source))
    return []


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _decode(raw: bytes, source: str, offset: int, line: int) -> str:
    """``raw`` (the bytes from byte ``offset``, line ``line`` of the file) as text; not UTF-8: an error naming the
    first bad byte. A byte order mark that starts the file is dropped (``offset`` 0)."""
    if offset == 0 and raw.startswith(codecs.BOM_UTF8):
        return _decode(raw[len(codecs.BOM_UTF8):], source, len(codecs.BOM_UTF8), line)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        bad, line = raw[err.start : err.start + 1], line + raw.count(b"\n", 0, err.start)
        raise DataFormatError(
            f"Data file '{source}' is not UTF-8: byte {bad!r} at byte offset {offset + err.start} (line {line}) "
            f"cannot be decoded ({err.reason}). Save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)."
        ) from None


def _check_json(path: Path, source: str) -> list[str]:
    """A .json file is one document (an array of rows, or an object) or JSON lines; a .jsonl file is JSON lines."""
    types = ColumnTypes(source)
    if path.suffix.lower() != ".json" or _check_json_document(_decode(path.read_bytes(), source, 0, 1), source, types):
        types = ColumnTypes(source)
        _check_json_lines(path, source, types)
    types.check()
    return types.columns()


def _check_json_document(text: str, source: str, types: ColumnTypes | _RowLines) -> bool:
    """Check a whole JSON document; True when it turns out to be JSON lines (more than one value)."""
    decoder = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys)

    def skip(i: int) -> int:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def line_of(i: int) -> int:
        return text.count("\n", 0, i) + 1

    def at(i: int) -> str:  # "line L, column C" of position i (both from 1)
        column = i - text.rfind("\n", 0, i)
        return f"line {line_of(i)}, column {column}"

    def decode(i: int, row: bool = False) -> int:
        try:
            value, end = decoder.raw_decode(text, i)
        except _DuplicateKey as err:
            raise DataFormatError(
                f"Data file '{source}', line {line_of(i)}: the object starting there repeats the key '{err.key}'; "
                "JSON keeps only the last value. Remove or rename the duplicate."
            ) from None
        except json.JSONDecodeError as err:
            line, column = _error_position(err)
            raise DataFormatError(
                f"Data file '{source}', line {line}, column {column}: invalid JSON ({err.msg})."
            ) from None
        if row and isinstance(value, dict):
            types.add(value, line_of(i))
        return end

    i = skip(0)
    if not text.startswith("[", i):  # one object, or JSON lines
        return skip(decode(i, row=True)) < len(text)
    i = skip(i + 1)
    while not text.startswith("]", i):
        i = skip(decode(i, row=True))  # one row of the array
        if text.startswith(",", i):
            comma, i = i, skip(i + 1)
            if text.startswith("]", i):
                raise DataFormatError(f"Data file '{source}', {at(comma)}: invalid JSON (a comma before ']').")
        elif not text.startswith("]", i):
            raise DataFormatError(f"Data file '{source}', {at(min(i, len(text.rstrip())))}: invalid JSON (expected ',' "
                                  "or ']').")
    if skip(i + 1) < len(text):
        raise DataFormatError(f"Data file '{source}', {at(skip(i + 1))}: invalid JSON (text after the array).")
    return False


def _check_json_lines(path: Path, source: str, types: ColumnTypes | _RowLines) -> None:
    offset, rows = 0, 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _decode(raw, source, offset, number)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                value = json.loads(line, object_pairs_hook=_no_duplicate_keys)
            except _DuplicateKey as err:
                raise DataFormatError(
                    f"Data file '{source}', line {number}: the key '{err.key}' appears twice in one object; JSON keeps "
                    "only the last value. Remove or rename the duplicate."
                ) from None
            except json.JSONDecodeError as err:
                line_in, column = _error_position(err)
                raise DataFormatError(
                    f"Data file '{source}', line {number + line_in - 1}, column {column}: invalid JSON ({err.msg}). "
                    "Each line of a JSON-lines file must be one complete JSON object."
                ) from None
            if not isinstance(value, dict):
                raise DataFormatError(
                    f"Data file '{source}', line {number}: expected a JSON object (a row with named columns), got "
                    f"{type(value).__name__} {line.strip()[:60]!r}."
                )
            types.add(value, number)
            rows += 1
    if not rows:
        raise DataFormatError(f"Data file '{source}' holds no rows: its {number} line(s) are all blank. Write one JSON "
                              "object per line.")


def _error_position(err: json.JSONDecodeError) -> tuple[int, int]:
    """The line and column (from 1) of ``err`` in the text it decoded (``err.doc``). An error at the end of the text
    (a value cut short: a truncated line, a missing ``}``) is placed just past its last character: ``json`` places it
    after the whitespace that follows, so a JSON-lines line (decoded alone, its newline included) named column 1 of
    the line after it, and a document the line after its last."""
    pos = min(err.pos, len(err.doc.rstrip(" \t\r\n")))
    return err.doc.count("\n", 0, pos) + 1, pos - err.doc.rfind("\n", 0, pos)


class _RowLines:
    """Collects the line (from 1) each row of a JSON file starts at, in place of ``ColumnTypes`` (``row_line``)."""

    def __init__(self) -> None:
        self.lines: list[int] = []

    def add(self, row: dict[str, Any], line: int) -> None:
        self.lines.append(line)


def row_line(source: Any, row: int) -> int | None:
    """The line (from 1) at which row ``row`` (from 0) of a local json/jsonl/csv file starts (None: another source,
    or no such row). For error messages: it reads the file again."""
    if not isinstance(source, (str, Path)):
        return None
    path = Path(source).expanduser()
    kind = FILE_BUILDERS.get(path.suffix.lower())
    if not path.is_file() or kind not in ("json", "csv"):
        return None
    if kind == "csv":
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            next(reader, None)  # the header
            start = reader.line_num + 1
            for i, _ in enumerate(reader):
                if i == row:
                    return start
                start = reader.line_num + 1
        return None
    lines = _RowLines()
    if path.suffix.lower() != ".json" or _check_json_document(path.read_text(encoding="utf-8-sig"), str(source), lines):
        lines = _RowLines()
        _check_json_lines(path, str(source), lines)
    return lines.lines[row] if 0 <= row < len(lines.lines) else None


def _check_csv(path: Path, source: str) -> list[str]:
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            _decode(raw, source, offset, number)
            offset += len(raw)
    with open(path, newline="", encoding="utf-8-sig") as f:  # the header's first name without a byte order mark
        header = next(csv.reader(io.StringIO(f.readline())), [])
    seen: set[str] = set()
    for column in header:
        if column in seen:
            raise DataFormatError(
                f"Data file '{source}': the CSV header names the column '{column}' twice; one of them would be "
                "renamed or lost. Give every column its own name."
            )
        seen.add(column)
    return header
