"""One JSON type per column, checked on the rows as the file holds them (before ``datasets`` reads it).

``datasets``' JSON reader gives a column one type: a ``2`` among strings like ``"60"`` turns the whole column into
numbers (or fails), so a check after loading names a row that was fine (``row 0 ... got int 60``) and never the
file's bad line. ``ColumnTypes`` sees every row as ``json.loads`` returns it (the source check parses each line
anyway) and records, per column and per field inside one (``messages[].content``, ``chosen[].role``), how many rows
hold each JSON type and the first line of each. A column holding two types is refused naming the line of the rarer
one (the odd one out), its value, and the type the other rows have. A message's ``content`` may mix strings and
lists of content parts (TRL's image conversations: parts in the user turn, a string answer), which ``datasets``
keeps as JSON values. ``null`` (and a missing key) is no type: rows may
leave a column out. Integers and floats are one type (numbers).
"""

from __future__ import annotations

from typing import Any

from lightalign.datamodules.formats import DataFormatError

_NAMES = {"string": "a string", "number": "a number", "bool": "a boolean", "list": "a list", "object": "an object"}


# what ``json.loads`` returns -> its JSON type (null: no type)
_KINDS = {str: "string", int: "number", float: "number", bool: "bool", list: "list", dict: "object", type(None): None}


class ColumnTypes:
    """The JSON types each column (and nested field) of a file's rows holds; ``check`` refuses a mix."""

    def __init__(self, source: str) -> None:
        self.source = source
        # path -> kind -> [rows holding it, first line, first value]
        self.seen: dict[str, dict[str, list]] = {}
        self._children: dict[tuple[str, str], str] = {}  # (path, key or "[]") -> the child's path, built once

    def add(self, row: dict[str, Any], line: int) -> None:
        """Record one row (a JSON object) read at ``line`` (counted from 1)."""
        for key, value in row.items():
            self._record(key, value, line)

    def _record(self, path: str, value: Any, line: int) -> None:
        kind = _KINDS[type(value)]
        if kind is None:
            return
        kinds = self.seen.get(path)
        if kinds is None:
            kinds = self.seen[path] = {}
        entry = kinds.get(kind)
        if entry is None:
            kinds[kind] = [1, line, value]
        else:
            entry[0] += 1
        if kind == "object":
            for key, item in value.items():
                self._record(self._child(path, key), item, line)
        elif kind == "list":
            child = self._child(path, "[]")
            for item in value:
                self._record(child, item, line)

    def _child(self, path: str, key: str) -> str:
        child = self._children.get((path, key))
        if child is None:
            child = self._children[(path, key)] = path + key if key == "[]" else f"{path}.{key}"
        return child

    def columns(self) -> list[str]:
        """The top-level columns seen, in first-seen order."""
        return [p for p in self.seen if "." not in p and "[" not in p]

    def check(self) -> None:
        for path, kinds in self.seen.items():
            if len(kinds) < 2 or (path.endswith("[].content") and set(kinds) == {"string", "list"}):
                continue
            # the odd one out: the rarest type (on a tie, the one that appeared later)
            odd = min(kinds, key=lambda k: (kinds[k][0], -kinds[k][1]))
            usual = max((k for k in kinds if k != odd), key=lambda k: kinds[k][0])
            count, line, value = kinds[odd]
            others, first = kinds[usual][0], kinds[usual][1]
            column = path.split(".")[0].split("[")[0]
            where = f"column '{column}'" + (f" (at {path})" if path != column else "")
            what = "row(s)" if path == column else "value(s)"
            fix = (f" Write it as {_as_string(value)} if it is text." if usual == "string" and odd in ("number", "bool")
                   else "")
            raise DataFormatError(
                f"Data file '{self.source}', line {line} (lines counted from 1): {where} holds {_NAMES[odd]} "
                f"{_short(value)}, but {others} other {what} hold {_NAMES[usual]} there (the first at line {first})"
                f"{f'; {count} {what} hold {_NAMES[odd]}' if count > 1 else ''}. A column must have one type in every "
                f"row (datasets would convert the whole column).{fix}"
            )


def _short(value: Any) -> str:
    import json

    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_string(value: Any) -> str:
    import json

    return json.dumps(json.dumps(value) if not isinstance(value, str) else value)
