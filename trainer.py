"""What every run gets, defined once for the console script and the Python API, and ``lightalign.Trainer``.

``TRAINER_DEFAULTS`` (the logger, ``log_every_n_steps``, the checkpoint plugin) and ``RUN_CALLBACKS`` (the callbacks,
each with the arguments whose run default differs from its class's) are read by both ways of running:

* ``LightalignCLI`` (``lightalign.cli``) sets ``TRAINER_DEFAULTS`` as its ``--trainer.*`` defaults and offers each
  ``RUN_CALLBACKS`` entry as the option group ``--<key>.*`` (``--checkpoint.save_top_k``, ``--export.output_dir``);
* ``Trainer`` (``lightalign.Trainer``) builds the same logger, plugin and callbacks with the same defaults.

Both pick the callbacks with ``run_callbacks``, so a Python run writes what the console run writes: ``metrics.csv``
with every step, ``checkpoints/last.ckpt``, ``hf_model/`` with its model card, ``versions.json``, and
``curves.png`` with ``PlotCurves(enabled=True)``. The console also writes ``config.yaml`` (LightningCLI's resolved
config); a Python run has no such config, and its module's hyperparameters are in the logger's ``hparams.yaml``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import lightning as L
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ProgressBar

from lightalign.callbacks import (CompletionSamples, HFExport, HubPush, PlotCurves, RunCheckpoint, RunFolder,
                                  RunSummary, RunVersions, StepProgressBar, TokenThroughput)
from lightalign.run_fit import fit_run
from lightalign.strategies.launch import RankLogging

#: The ``--trainer.*`` defaults of the console script and ``Trainer``'s: metrics of every optimizer step in
#: ``runs/<name>/version_N/metrics.csv`` (Lightning logs every 50 steps and to TensorBoard when it is installed), and
#: checkpoints written under a temporary name and renamed (``AtomicCheckpointIO``: a kill never leaves half a file).
TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": "runs", "name": "lightalign"},
    },
    "log_every_n_steps": 1,
    "plugins": [{"class_path": "lightalign.strategies.AtomicCheckpointIO"}],
}


@dataclass(frozen=True)
class RunCallback:
    """One callback every run gets.

    ``key`` names its console option group (``--export.*``); ``defaults`` are the arguments whose run default
    differs from the class's own; ``skip`` the arguments the console does not offer (Python objects, secrets).
    A callback the user passes replaces this one when it is a ``replaced_by`` (default: ``cls``). ``needs`` names
    the Trainer argument that, set to False, drops it (Lightning refuses the callback without that feature).
    """

    key: str
    cls: type[Callback]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    skip: frozenset[str] = frozenset()
    replaced_by: type | None = None
    needs: str | None = None

    def build(self, **init_args: Any) -> Callback:
        """The callback with the run's defaults, ``init_args`` overriding them (what the console builds from
        ``--<key>.*``)."""
        return self.cls(**{**self.defaults, **init_args})

    def replaced(self, own: Sequence[Callback]) -> bool:
        """One of the user's callbacks ``own`` takes this one's place."""
        return any(isinstance(callback, self.replaced_by or self.cls) for callback in own)


#: The callbacks of every run, in the order they run (Lightning moves the checkpoint callback last). ``checkpoint``:
#: ``last.ckpt`` only (also at the final step), and one per run folder: a run continued from an earlier checkpoint (a
#: rollback) overwrites it rather than writing ``last-v1.ckpt`` beside the abandoned branch's, which
#: ``ckpt_path="last"`` would then continue. ``summary`` comes after ``plot`` (the table names the PNG); ``hub`` last:
#: its fit-end push runs once everything local is written. ``hub`` takes no ``api`` (a Python object) and no
#: ``hub_token`` on the console (``config.yaml`` would record it: the token comes from HF_TOKEN or ``hf auth login``).
RUN_CALLBACKS: tuple[RunCallback, ...] = (
    RunCallback("checkpoint", RunCheckpoint, {"save_last": True, "save_top_k": 0, "enable_version_counter": False},
                needs="enable_checkpointing"),
    RunCallback("export", HFExport),
    RunCallback("throughput", TokenThroughput),
    RunCallback("lr_monitor", LearningRateMonitor, {"logging_interval": "step"}, needs="logger"),
    RunCallback("completions", CompletionSamples),
    RunCallback("progress_bar", StepProgressBar, replaced_by=ProgressBar, needs="enable_progress_bar"),
    RunCallback("plot", PlotCurves),
    RunCallback("summary", RunSummary),
    RunCallback("logging", RankLogging),
    RunCallback("hub", HubPush, skip=frozenset({"api", "hub_token"})),
)


def run_callbacks(settings: Mapping[str, Any], own: Sequence[Callback],
                  build: Callable[[RunCallback], Callback]) -> list[Callback]:
    """The ``RUN_CALLBACKS`` a Trainer with keyword arguments ``settings`` and the user's callbacks ``own`` gets, each
    built by ``build``, in table order. Left out: an entry that one of ``own`` replaces (the user's
    ``HFExport(output_dir=...)`` instead of the default export, any progress bar instead of ``StepProgressBar``), and
    an entry whose ``needs`` is False in ``settings`` (``enable_progress_bar``, ``enable_checkpointing``, ``logger``:
    Lightning refuses a progress bar, a ModelCheckpoint or a LearningRateMonitor without them)."""
    kept = []
    for entry in RUN_CALLBACKS:
        if entry.needs is not None and settings.get(entry.needs) is False:
            continue
        if entry.replaced(own):
            continue
        kept.append(build(entry))
    return kept


def _instance(spec: Mapping[str, Any], **init_args: Any) -> Any:
    """The object a ``TRAINER_DEFAULTS`` entry (``class_path`` + ``init_args``) describes, ``init_args`` overriding."""
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**{**spec.get("init_args", {}), **init_args})


class Trainer(L.Trainer):
    """Lightning's ``Trainer`` with the console script's defaults, so a Python run writes what ``lightalign fit``
    writes, into one run folder (``lightalign.runs``)::

        trainer = lightalign.Trainer(max_steps=300, name="my-sft", checkpoint={"every_n_train_steps": 100})
        trainer.fit(SFTModule(...), SFTDataModule(...))   # -> runs/my-sft/version_N/

    Defaults (``TRAINER_DEFAULTS``, ``RUN_CALLBACKS``): a ``CSVLogger`` writing ``runs/<name>/version_N/metrics.csv``
    (relative to the working directory, as the console's), ``log_every_n_steps=1``, ``AtomicCheckpointIO``, and the
    console's callbacks with the console's defaults: ``last.ckpt`` in ``checkpoints/``, the Hugging Face export in
    ``hf_model/``, tokens/s, the learning rate per step, sampled completions, the step progress bar, the summary
    table, per-rank log levels (restored at teardown), ``versions.json``; the curves and the Hub push are off unless
    enabled (``plot={"enabled": True}``, ``hub={"push_to_hub": True, "hub_model_id": ...}``). Every
    ``lightning.Trainer`` argument is taken and wins over a default:

    * a callback of a ``RUN_CALLBACKS`` class in ``callbacks`` replaces the default one, with its own arguments only
      (``HFExport(output_dir="my-model")``; any progress bar replaces ``StepProgressBar``); to change a few
      arguments and keep the run defaults of the others, pass the callback's key instead (Args);
    * ``logger``: another logger (or loggers) instead of the CSV one; ``False`` logs nothing (and drops the
      learning-rate monitor); ``enable_checkpointing=False`` drops the checkpoints, ``enable_progress_bar=False``
      the bar; ``plugins`` replaces ``AtomicCheckpointIO``, as ``--trainer.plugins`` does.

    Args:
        name: the run's folder under ``runs/`` (the default ``CSVLogger``'s ``name``); default ``lightalign``, as the
            console's when a config names no logger. Only with the default logger: another logger names its own.
        checkpoint, export, throughput, lr_monitor, completions, progress_bar, plot, summary, logging, hub: a dict of
            arguments for that default callback, over its run defaults, as the console's ``--<key>.*`` group or
            YAML section of the same name: ``checkpoint={"every_n_train_steps": 100}, plot={"enabled": True}``
            (one key per ``RUN_CALLBACKS`` entry).

    ``fit(..., ckpt_path="last")`` continues the newest run of ``runs/<name>`` that has ``checkpoints/last.ckpt``, in
    its folder and ``metrics.csv``, after checking the checkpoint against the module and data, as the console's
    ``--ckpt_path last`` does (``lightalign.run_fit.fit_run``); with no such run it starts a new one. The console also
    seeds (``seed_everything: 42``); from Python call ``lightning.seed_everything`` yourself.
    """

    def __init__(self, *, name: str | None = None, **kwargs: Any) -> None:
        groups = {entry.key: kwargs.pop(entry.key) for entry in RUN_CALLBACKS if entry.key in kwargs}
        if kwargs.get("logger") in (None, True):
            kwargs["logger"] = _instance(TRAINER_DEFAULTS["logger"], **({"name": name} if name is not None else {}))
        elif name is not None:
            raise ValueError(f"lightalign.Trainer(name={name!r}) names the default CSVLogger's folder, and logger="
                             f"{kwargs['logger']!r} replaces that logger: name the run in your logger instead, or drop "
                             "logger= to write runs/<name>/version_N.")
        kwargs.setdefault("log_every_n_steps", TRAINER_DEFAULTS["log_every_n_steps"])
        if kwargs.get("plugins") is None:
            kwargs["plugins"] = [_instance(spec) for spec in TRAINER_DEFAULTS["plugins"]]
        own = kwargs.get("callbacks") or []
        own = list(own) if isinstance(own, (list, tuple)) else [own]
        for entry in RUN_CALLBACKS:
            if entry.key in groups and entry.replaced(own):
                raise ValueError(f"lightalign.Trainer got {entry.key}= and a {entry.cls.__name__} in callbacks: the "
                                 f"callback replaces the default one that {entry.key}= configures. Pass one of them.")
        run = run_callbacks(kwargs, own, lambda entry: entry.build(**(groups.get(entry.key) or {})))
        self.run_folder = RunFolder()  # first: the callbacks after it find the run folder at their setup
        kwargs["callbacks"] = [self.run_folder, *own, *run, RunVersions()]
        super().__init__(**kwargs)

    @property
    def run_dir(self) -> Path | None:
        """The run folder (``runs/<name>/version_N``), once ``fit`` has set it up; None before."""
        return self.run_folder.path

    def fit(self, model: L.LightningModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: L.LightningDataModule | None = None, ckpt_path: str | Path | None = None,
            weights_only: bool | None = None) -> None:
        """``lightning.Trainer.fit``; ``ckpt_path="last"`` or a checkpoint inside a run folder continues that run
        (see the class docstring)."""
        if isinstance(train_dataloaders, L.LightningDataModule):  # trainer.fit(module, data), as Lightning allows
            datamodule, train_dataloaders = train_dataloaders, None
        fit_run(self, super().fit, model, datamodule, ckpt_path, train_dataloaders=train_dataloaders,
                val_dataloaders=val_dataloaders, weights_only=weights_only)
