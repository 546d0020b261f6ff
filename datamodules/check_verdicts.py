"""Passing verdicts of the data checks that read every row in Python, kept on disk so that a second run on the same
data with the same settings skips them.

Two checks read a whole split before training: ``sources.check_file`` (the file itself, before ``datasets`` loads
it: UTF-8, JSON that parses, one type per column, CSV headers) and a datamodule's row validation
(``SFTDataModule.validate``: the loaded rows against the run's settings). Each is a pure function of what it reads,
of the settings it reads and of its own code. A pass is recorded under a key made of exactly those (``passed``); a
check whose key has a recorded pass returns the recorded result without reading the data:

* a file (``file_key``): its resolved path, size and modification time in nanoseconds. These are the facts
  ``datasets``' json and csv builders decide their cache of a local file by (its path and modification time), with
  the size added: a file whose verdict is reused is one ``datasets`` does not read again either, it loads the rows
  it built from the file that passed.
* the loaded rows (``rows_key``): the ``Dataset``'s own fingerprint (``Dataset._fingerprint``), with every setting
  the validation reads (the caller's ``settings``: format, text column, loss masks, a hash of the chat template)
  and the datamodule's class. ``datasets`` derives the fingerprint from where the rows come from (the builder's
  configuration with its files' modification times, an in-memory table's content, the transforms applied since)
  and keys its own caches on it: the tokenization that follows the validation is reused under a fingerprint
  derived from this one. A verdict that outlived its rows would come with tokenized rows that outlived them too,
  so the verdict cannot disagree with what is trained.

Every key also holds a hash of the checks' code (``code_hash``: the sources of this package and of the
datamodule class's modules), so an edited check never reuses a verdict of the old code.

Only passes are recorded: a file or split that fails is checked again on every run and raises its error naming the
line or row. Verdicts live in ``data_checks/`` beside the layout probe's (``cache_folder.cache_root``:
``LIGHTALIGN_CACHE_DIR`` moves them); ``LIGHTALIGN_PROBE_CACHE=0`` turns this disk cache off as it does the probe's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from lightalign.modules.training.cache_folder import cache_root, read_verdict, write_verdict

if TYPE_CHECKING:
    from datasets import Dataset

T = TypeVar("T")


def cache_dir() -> Path:
    return cache_root() / "data_checks"


@functools.cache
def code_hash(files: tuple[str, ...] = ()) -> str:
    """A hash of the sources of this package's modules (where the checks live) and of ``files`` (a datamodule
    class's own modules)."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")) + [Path(f) for f in sorted(set(files))]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def file_key(path: Path) -> dict[str, Any]:
    """What a file's verdict is reused for: its resolved path, size and modification time (ns)."""
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def rows_key(raw: Dataset, owner: type, settings: dict[str, Any]) -> dict[str, Any]:
    """What a split's validation verdict is reused for: the rows' fingerprint, the datamodule class ``owner`` (and
    the code of its modules), and the ``settings`` its validation reads."""
    files = tuple(getattr(sys.modules.get(cls.__module__), "__file__", None) or "" for cls in owner.__mro__
                  if cls.__module__.partition(".")[0] not in ("builtins", "lightning"))
    return {"fingerprint": raw._fingerprint, "class": f"{owner.__module__}.{owner.__qualname__}",
            "class_code": code_hash(tuple(f for f in files if f)), "settings": settings}


def value_hash(value: Any) -> str | None:
    """A short hash of a long setting (a chat template) for a key; None stays None."""
    if value is None:
        return None
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:32]


def passed(kind: str, key: dict[str, Any], check: Callable[[], T]) -> T:
    """``check()``'s result, or the result recorded when ``check`` passed with the same ``kind`` and ``key`` (then
    ``check`` does not run). A check that raises records nothing."""
    material = json.loads(json.dumps({"kind": kind, "code": code_hash(), **key}, sort_keys=True))
    name = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]
    stored = _read(name)
    if stored is not None and stored.get("key") == material:
        return stored["result"]
    result = check()
    _write(name, {"key": material, "result": result})
    return result


def _read(name: str) -> dict | None:
    data = read_verdict(cache_dir(), name)
    return data if isinstance(data, dict) else None


def _write(name: str, data: dict) -> None:
    write_verdict(cache_dir(), name, data)
