"""Where lightalign keeps what it measured on this machine (the layout probe's verdicts, the device-tuned
constants' first-use verdicts): ``LIGHTALIGN_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightalign``, else
``~/.cache/lightalign``; each kind in a folder of its own below it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("LIGHTALIGN_CACHE_DIR")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lightalign")
    return Path(root)
