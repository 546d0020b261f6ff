"""What the ``lightalign`` console script keeps out of a run's output: library messages a user cannot act on.

``console_quiet()`` is a context manager ``cli.main`` wraps a command in; everything it changes is undone when the
command ends, and nothing here runs at import (the Python API and the tests' in-process runs are left alone).
It drops, and only these:

* Lightning's "Tip: ... litlogger" advertisement (printed at every Trainer construction);
* DeepSpeed's "Setting accelerator to CPU" warning (transformers imports DeepSpeed when it is installed, also on a
  CPU-only run that does not use it);
* torch's ``LeafSpec`` deprecation FutureWarning raised inside Lightning's own code;
* progress bars of datasets and transformers ("Generating train split", "Tokenizing", "Writing model shards") when
  standard error is not a terminal: in a log file every redraw becomes a line; on a terminal they redraw in place
  and stay.

transformers' and datasets' INFO messages (the model config dumped at every load, "Configuration saved in ...")
are a log-level matter: ``RankLogging`` (``--logging.*``) keeps those libraries at WARNING unless ``log_level`` is
``debug``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from typing import Iterator

# (logger name, start of the message) of the records dropped
DROPPED_RECORDS = (
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud"),
    ("lightning.fabric.utilities.rank_zero", "💡 Tip: For seamless cloud"),
    ("DeepSpeed", "Setting accelerator to CPU."),
)
DROPPED_WARNINGS = (  # (category, regex of the message's start)
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
)


class DropMessages(logging.Filter):
    """Drops the records of one logger whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not message.startswith(self.prefixes)


@contextlib.contextmanager
def console_quiet(progress_bars: bool | None = None) -> Iterator[None]:
    """Drop the messages listed in the module docstring while the block runs. ``progress_bars``: keep the
    libraries' progress bars (default: only when standard error is a terminal)."""
    if progress_bars is None:
        progress_bars = sys.stderr.isatty()
    prefixes: dict[str, tuple[str, ...]] = {}
    for name, prefix in DROPPED_RECORDS:
        prefixes[name] = prefixes.get(name, ()) + (prefix,)
    filters = [(logging.getLogger(name), DropMessages(p)) for name, p in prefixes.items()]
    for logger, drop in filters:
        logger.addFilter(drop)
    restore_bars = [] if progress_bars else _disable_progress_bars()
    try:
        with warnings.catch_warnings():
            for category, message in DROPPED_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category)
            yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)
        for enable in restore_bars:
            enable()


def _disable_progress_bars() -> list:
    """Turn off datasets' and transformers' progress bars; the functions that turn back on those that were on."""
    restore = []
    try:
        from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        if not are_progress_bars_disabled():
            disable_progress_bars()
            restore.append(enable_progress_bars)
    except ImportError:
        pass
    try:
        from transformers.utils import logging as transformers_logging

        if transformers_logging.is_progress_bar_enabled():
            transformers_logging.disable_progress_bar()
            restore.append(transformers_logging.enable_progress_bar)
    except ImportError:
        pass
    return restore
