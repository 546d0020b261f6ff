"""What the ``lightalign`` console script keeps out of a run's output: library messages a user cannot act on.

``console_quiet()`` is a context manager ``cli.main`` wraps a command in; everything it changes is undone when the
command ends, and nothing here runs at import (the Python API and the tests' in-process runs are left alone).
It drops, and only these:

* Lightning's "Tip: ... litlogger" advertisement (printed at every Trainer construction);
* DeepSpeed's "Setting accelerator to CPU" warning (transformers imports DeepSpeed when it is installed, also on a
  CPU-only run that does not use it);
* torch's ``LeafSpec`` deprecation FutureWarning raised inside Lightning's own code;
* Lightning's "Seed set to 42" and "GPU available: ... / TPU available: ..." lines until the run has passed the
  refusals that come before training starts (the config, the Trainer settings, the data's rows, the module's checks
  of the data and knobs in its ``setup`` and of the models it loads): they are printed when the run starts (the
  first callback's ``on_fit_start``: ``ReleaseHeldLines``, added by the CLI), so a refused run prints its one-line
  error and nothing before it;
* the file-path prefix and the source line Python prints with a warning (``<file>:<line>: UserWarning: ...``
  followed by ``  rank_zero_warn(note)``): a warning is one line, ``UserWarning: <message>``, the warnings of
  lightalign and Lightning (whose text says what to do) without a location, the other libraries' with their file
  and line inside site-packages, where a user would look;
* progress bars of datasets and transformers ("Generating train split", "Tokenizing", "Writing model shards") when
  standard error is not a terminal: in a log file every redraw becomes a line; on a terminal they redraw in place
  and stay. datasets (with pandas and pyarrow, about a second of CPU) is not imported for this: ``--help`` and the
  refusals before the data is read never need it. Its bars are turned off as soon as something imports it
  (``AfterImport``), or at once if it already is.

``exact_resume_quiet(datamodule)`` (the CLI wraps ``trainer.fit`` in it, console or not) drops Lightning's "You're
resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable" for lightalign's
own datamodules, where it is false: ``TokenizedDataModule.state_dict`` records the epoch and the batches trained and its
samplers skip exactly those on resume (``TokenizedDataModule.load_state_dict``, ``EpochSampler``). A datamodule of the
user's own keeps the warning.

transformers' and datasets' INFO messages (the model config dumped at every load, "Configuration saved in ...")
are a log-level matter: ``RankLogging`` (``--logging.*``) keeps those libraries at WARNING unless ``log_level`` is
``debug``.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning as L

# (logger name, start of the message) of the records dropped
DROPPED_RECORDS = (
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud"),
    ("lightning.fabric.utilities.rank_zero", "💡 Tip: For seamless cloud"),
    ("DeepSpeed", "Setting accelerator to CPU."),
)
DROPPED_WARNINGS = (  # (category, regex of the message's start)
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
)
# (logger name, regex of the message's start) of the records held back until the run starts (see the docstring)
HELD_RECORDS = (
    ("lightning.fabric.utilities.seed", r"(\[rank: \d+\] )?Seed set to "),
    ("lightning.pytorch.utilities.rank_zero", r"(GPU|TPU) available: "),
)
INEXACT_RESUME_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended"


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


class HoldMessages(logging.Filter):
    """Keeps back the records of one logger whose message matches ``pattern`` (``held``) until ``release``."""

    def __init__(self, logger: logging.Logger, pattern: str) -> None:
        super().__init__()
        self.logger, self.pattern, self.held = logger, re.compile(pattern), []

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        if self.pattern.match(message):
            self.held.append(record)
            return False
        return True

    def release(self) -> None:
        """Stop holding and emit what was held, in order (through the logger's handlers, as it would have been)."""
        self.logger.removeFilter(self)
        held, self.held = self.held, []
        for record in held:
            self.logger.handle(record)


_HOLDING: list[HoldMessages] = []  # console_quiet's, while its block runs


def release_held_lines() -> None:
    """Print the lines console_quiet has held back and hold no more (nothing outside its block)."""
    while _HOLDING:
        _HOLDING.pop(0).release()


class ReleaseHeldLines(L.Callback):
    """The CLI's first callback: the held lines are printed when the run starts (``on_fit_start``, or the start of
    validate/test/predict), i.e. once the data's rows were read and checked (the datamodule's ``setup``) and the
    module's own checks of the data and the knobs (its ``setup``, which Lightning calls after the callbacks') and of
    the models (``configure_model``) have passed."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        release_held_lines()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        release_held_lines()

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        release_held_lines()

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        release_held_lines()


PACKAGE_DIR = Path(__file__).resolve().parent


def one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                     line: str | None = None) -> str:
    """``warnings.formatwarning`` for the console (see the module docstring)."""
    text = " ".join(str(message).split())
    path = Path(filename).resolve()
    ours = path.is_relative_to(PACKAGE_DIR) or "lightning" in path.parts
    where = "" if ours else f" ({filename.rpartition('site-packages/')[2]}:{lineno})"
    return f"{category.__name__}: {text}{where}\n"


@contextlib.contextmanager
def exact_resume_quiet(datamodule: Any) -> Iterator[None]:
    """Drop Lightning's inexact-resume warning while the block runs, if ``datamodule`` resumes exactly (see the
    module docstring); otherwise change nothing."""
    from lightalign.datamodules.base import TokenizedDataModule

    if not isinstance(datamodule, TokenizedDataModule):
        yield
        return
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=INEXACT_RESUME_WARNING, category=PossibleUserWarning)
        yield


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
    holding = [HoldMessages(logging.getLogger(name), pattern) for name, pattern in HELD_RECORDS]
    for hold in holding:
        hold.logger.addFilter(hold)
    _HOLDING.extend(holding)
    restore_bars = [] if progress_bars else _disable_progress_bars()
    formatwarning, warnings.formatwarning = warnings.formatwarning, one_line_warning
    try:
        with warnings.catch_warnings():
            for category, message in DROPPED_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category)
            yield
    finally:
        warnings.formatwarning = formatwarning
        for logger, drop in filters:
            logger.removeFilter(drop)
        for hold in holding:  # a command that ended before its start (a refusal, --help): the held lines are dropped
            hold.logger.removeFilter(hold)
            if hold in _HOLDING:
                _HOLDING.remove(hold)
        for enable in restore_bars:
            enable()


def _disable_progress_bars() -> list:
    """Turn off datasets' and transformers' progress bars; the functions that turn back on those that were on."""
    restore: list = []

    def datasets_bars_off() -> None:
        from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        if not are_progress_bars_disabled():
            disable_progress_bars()
            restore.append(enable_progress_bars)

    if DATASETS_BARS in sys.modules:
        datasets_bars_off()
    else:  # not imported for the bars' sake: off once something imports it
        hook = AfterImport(DATASETS_BARS, datasets_bars_off)
        sys.meta_path.insert(0, hook)
        restore.append(hook.remove)
    try:
        from transformers.utils import logging as transformers_logging

        if transformers_logging.is_progress_bar_enabled():
            transformers_logging.disable_progress_bar()
            restore.append(transformers_logging.enable_progress_bar)
    except ImportError:
        pass
    return restore


DATASETS_BARS = "datasets.utils.tqdm"  # the module holding datasets' progress-bar switch


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then()`` right after module ``name`` is imported, while this finder is on ``sys.meta_path``.

    It finds nothing itself: it asks the finders after it for the module's spec and wraps the spec's loader so that
    ``then()`` runs once the module has executed."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != self.name:
            return None
        self.remove()  # once: the finders after it find the module as they would without it
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, then = spec.loader, self.then

        class ThenLoader(importlib.abc.Loader):
            def __getattr__(self, attribute):  # get_source, get_resource_reader, ...: the module's own loader's
                return getattr(loader, attribute)

            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                then()

        spec.loader = ThenLoader()
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
