"""Where lightalign keeps what it measured on this machine (the layout probe's verdicts, the device-tuned
constants' first-use verdicts, the data checks' passes): ``LIGHTALIGN_CACHE_DIR``, else
``$XDG_CACHE_HOME/lightalign``, else ``~/.cache/lightalign``; each kind in a folder of its own below it, one JSON
file per verdict (``read_verdict`` / ``write_verdict``; ``LIGHTALIGN_PROBE_CACHE=0``: nothing read or written)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    root = os.environ.get("LIGHTALIGN_CACHE_DIR")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lightalign")
    return Path(root)


def disk_cache() -> bool:
    """Whether verdicts are read from and written to disk (``LIGHTALIGN_PROBE_CACHE``, default on)."""
    return os.environ.get("LIGHTALIGN_PROBE_CACHE", "1") != "0"


def read_verdict(folder: Path, name: str) -> Any:
    """The JSON value of ``folder/<name>.json`` (None: absent, unreadable, or the disk cache is off)."""
    if not disk_cache():
        return None
    try:
        return json.loads((folder / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def write_verdict(folder: Path, name: str, data: Any) -> None:
    """Write ``folder/<name>.json`` atomically: a concurrent reader sees the old file (or none) or the new one. A
    folder that cannot be written only costs the next process the measurement again."""
    if not disk_cache():
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:
            json.dump(data, f)
        os.replace(f.name, folder / f"{name}.json")
    except OSError:
        pass
