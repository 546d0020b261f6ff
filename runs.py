"""One run = one folder, and what ``--ckpt_path last`` continues.

Every run of the CLI writes everything it produces (metrics, ``config.yaml``, ``versions.json``, ``checkpoints/``,
``hf_model/``, ``curves.png``) into one folder, its *run folder*:

* with a ``CSVLogger`` or ``TensorBoardLogger`` (the first one of the config, if several): the logger's own
  ``<save_dir>/<name>/version_N``;
* with a ``WandbLogger`` only: ``<save_dir>/<project>/version_N`` (W&B keeps its own files in ``<save_dir>/wandb``);
* with an ``MLFlowLogger``, another logger or none: ``<default_root_dir>/runs/<name>/version_N``, ``name`` being the
  MLflow experiment name (``lightalign`` without a logger); MLflow's store holds the metrics.

``--ckpt_path last`` continues the newest ``version_N`` of that folder that holds ``checkpoints/last.ckpt``; a
checkpoint path inside one of those run folders continues that folder. Both are checked against the config first
(``check_resume``): another method, model or tokenizer, another batch layout or a ``max_steps`` already reached
is refused with a message naming both sides; another data file is a warning. ``lightalign.run_fit.fit_run`` is that
fit, for the console script (``LightalignCLI.fit``) and ``lightalign.Trainer.fit(..., ckpt_path="last")`` alike. A
run folder has one owner: the run claims it before writing into it and a second run targeting it meanwhile is
refused, naming the holder (``lightalign.run_lock``; ``RunFolder.take``). ``--ckpt_path`` may name a run folder: its ``last.ckpt``.
"""

from __future__ import annotations

import contextlib
import csv
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, TypeVar

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info

from lightalign.strategies.checkpoint_io import CheckpointError

CHECKPOINT_FACTS_KEY = "lightalign_run"  # what RunFolder records in every checkpoint (see checkpoint_facts)
T = TypeVar("T")
_VERSION = re.compile(r"^version_(\d+)$")


class RunError(ValueError):
    """A run that cannot go ahead as configured (nothing to train, an output folder that cannot be written)."""


class ResumeError(CheckpointError):
    """A checkpoint that does not belong to the run the config describes."""


# ------------------------------------------------------------------------------------------------- folders
def folder_logger(trainer: L.Trainer) -> Logger | None:
    """The logger that names the run folder: the first CSV/TensorBoard logger, else the first logger."""
    loggers = list(trainer.loggers)
    versioned = [lg for lg in loggers if isinstance(lg, (CSVLogger, TensorBoardLogger))]
    return versioned[0] if versioned else (loggers[0] if loggers else None)


def runs_root(trainer: L.Trainer) -> Path:
    """The folder holding the ``version_N`` run folders of this config (see the module docstring)."""
    logger = folder_logger(trainer)
    if isinstance(logger, (CSVLogger, TensorBoardLogger)):
        return Path(logger.root_dir)
    if type(logger).__name__ == "WandbLogger":
        return Path(logger.save_dir or ".") / str(logger.name or "lightalign")
    name = getattr(logger, "_experiment_name", None) if type(logger).__name__ == "MLFlowLogger" else None
    if name is None and logger is not None and isinstance(logger.name, str):
        name = logger.name
    return Path(trainer.default_root_dir) / "runs" / (name or "lightalign")


def version_of(folder: Path) -> int | None:
    match = _VERSION.match(folder.name)
    return int(match.group(1)) if match else None


def latest_run(root: Path) -> Path | None:
    """The newest ``version_N`` under ``root`` that holds ``checkpoints/last.ckpt`` (None: no such run)."""
    return newest_run_with(root, "checkpoints/last.ckpt")


def newest_run_with(root: Path, member: str) -> Path | None:
    """The newest ``version_N`` under ``root`` that holds the file ``member`` (None: no such run)."""
    runs = [p for p in Path(root).glob("version_*") if version_of(p) is not None and (p / member).is_file()]
    return max(runs, key=version_of) if runs else None


def latest_export(root: Path | str) -> Path:
    """The Hugging Face export (``hf_model``) of the newest ``version_N`` under ``root`` that wrote one: a run that
    stopped early (an error, a kill, a non-finite loss) has none and is passed over."""
    run = newest_run_with(Path(root), "hf_model/config.json")
    if run is None:
        raise FileNotFoundError(f"No run under '{root}' has a Hugging Face export (version_N/hf_model): a run writes "
                                "it when it finishes.")
    return run / "hf_model"


def run_of_checkpoint(checkpoint: Path, root: Path) -> Path | None:
    """The run folder under ``root`` a checkpoint file lives in (``root/version_N/checkpoints/x.ckpt``), else None."""
    folder = checkpoint.resolve().parent.parent
    if checkpoint.resolve().parent.name == "checkpoints" and version_of(folder) is not None \
            and root.resolve() == folder.parent:
        return folder
    return None


def new_run_folder(root: Path) -> Path:
    """Create and return the next free ``root/version_N`` (for loggers that do not number their runs)."""
    root.mkdir(parents=True, exist_ok=True)
    taken = [v for v in (version_of(p) for p in root.iterdir()) if v is not None]
    version = max(taken, default=-1) + 1
    while True:
        folder = root / f"version_{version}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:  # another run took it meanwhile
            version += 1


def discard_empty_run_folder(trainer: L.Trainer) -> Path | None:
    """Remove the run folder of a run that stopped before writing anything into it (a refusal while the data was
    read: Lightning's CSV logger creates ``version_N`` first), so no empty ``version_N`` is left beside the real runs.
    A folder holding anything is kept. Rank 0, for a new run only (not a resume). Returns the folder removed."""
    logger = folder_logger(trainer)
    if not isinstance(logger, (CSVLogger, TensorBoardLogger)) or not trainer.is_global_zero:
        return None  # other loggers' run folders are made by RunFolder at setup, after the data was read
    folder = Path(logger.log_dir)
    try:
        folder.rmdir()  # only an empty folder
    except OSError:
        return None
    with contextlib.suppress(OSError):  # and <save_dir>/<name>, if that was its only run
        folder.parent.rmdir()
    return folder


def pin_version(trainer: L.Trainer, version: int) -> None:
    """Make a CSV/TensorBoard logger write into ``version_N`` (the run being continued) instead of a new one."""
    logger = folder_logger(trainer)
    if isinstance(logger, (CSVLogger, TensorBoardLogger)):
        logger._version = version  # both loggers read their version lazily from here


def check_writable(folder: Path, what: str, knob: str) -> None:
    """Fail now, not after training, if ``folder`` cannot be created and written (probed with a temporary folder in
    its first existing parent, removed again)."""
    probe = Path(folder).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lightalign-probe-", dir=probe))
    except OSError as err:
        raise RunError(f"Cannot write {what} to {folder}: {probe} is not a writable folder ({err.strerror}). Choose a "
                       f"writable {knob}, or fix the folder's permissions.") from err


# ------------------------------------------------------------------------------------------------- metrics
def row_step(row: dict[str, str]) -> int | None:
    """The ``step`` of a logged CSV row (None where the row has none)."""
    value = row.get("step")
    return None if value in ("", None) else int(float(value))


def write_csv_atomically(path: Path, fieldnames: list[str], rows: list[dict[str, Any]]) -> None:
    """``rows`` under ``fieldnames`` as ``path``, written to a temp file and renamed over it (never half a file)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=fieldnames)
        out.writeheader()
        out.writerows(rows)
    os.replace(tmp, path)


def continue_metrics_csv(logger: CSVLogger, resume_step: int) -> int:
    """Keep the rows of the run's ``metrics.csv`` logged before ``resume_step`` (the checkpoint's global step) and
    make the logger append after them; call it before the logger has written anything. Rows the interrupted run
    wrote after its checkpoint are dropped: the resumed run logs those steps again. Returns the rows dropped.

    Lightning's CSVLogger deletes an existing ``metrics.csv`` when its writer starts, so the rows are copied aside
    first (``.metrics.csv.resume``, used instead if a previous attempt stopped before putting them back), the writer
    is started, and the kept rows are written back (temp file + rename) under the old header.
    """
    path = Path(logger.log_dir) / "metrics.csv"
    aside = path.with_name(".metrics.csv.resume")
    if path.is_file():
        shutil.copyfile(path, aside)
    if not aside.is_file():
        return 0
    with open(aside, newline="") as f:
        reader = csv.DictReader(f)
        fieldnames = list(reader.fieldnames or [])
        rows = list(reader)
    kept = [row for row in rows if (step := row_step(row)) is not None and step < resume_step]
    with warnings.catch_warnings():  # "Previous log files in this directory will be deleted": not on resume
        warnings.filterwarnings("ignore", message=".*exists and is not empty.*")
        writer = logger.experiment
    write_csv_atomically(path, fieldnames, kept)
    writer.metrics_keys = list(fieldnames)  # the writer appends under this header (or rewrites it with new keys)
    aside.unlink()
    return len(rows) - len(kept)


def continue_logs(trainer: L.Trainer, resume_step: int) -> int:
    """Make the run's CSV or TensorBoard logger continue after ``resume_step`` (see continue_metrics_csv; TensorBoard
    gets ``purge_step``, so its readers drop the events the interrupted run logged later). Rank 0, before fit."""
    logger = folder_logger(trainer)
    if isinstance(logger, CSVLogger):
        return continue_metrics_csv(logger, resume_step)
    if isinstance(logger, TensorBoardLogger):
        logger._kwargs.setdefault("purge_step", resume_step)  # passed to SummaryWriter when it is created
    return 0


def callback_of(trainer: L.Trainer, cls: type[T]) -> T | None:
    """The trainer's first callback that is a ``cls`` (its run's ``RunFolder``, ``HFExport``), or None."""
    return next((c for c in trainer.callbacks if isinstance(c, cls)), None)


# ------------------------------------------------------------------------------------------------- checkpoints
def checkpoint_facts(trainer: L.Trainer, module: L.LightningModule, datamodule: Any,
                     run_dir: Path | None) -> dict[str, Any]:
    """What a resume must agree with, recorded in each checkpoint (plain types: loads with weights_only)."""
    hparams = getattr(module, "hparams", {})
    tokenizer = getattr(datamodule, "_tokenizer_arg", None)
    path = getattr(datamodule, "path", None)
    return {
        "method": type(module).__name__,
        "model_name_or_path": _plain(hparams.get("model_name_or_path")),
        "tokenizer": _plain(tokenizer),
        "data_path": _plain(path),
        "data_size": _file_size(path),
        "batch_size": getattr(datamodule, "batch_size", None),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "world_size": trainer.world_size,
        "run_dir": str(run_dir) if run_dir is not None else None,
    }


def checkpoint_in(path: Path) -> Path:
    """The checkpoint ``--ckpt_path PATH`` names: a file as given; a run folder (or its ``checkpoints/``) its
    ``last.ckpt``, said in the log; another folder is refused, naming the checkpoints it holds."""
    if not path.is_dir():
        return path
    for last in (path / "checkpoints" / "last.ckpt", path / "last.ckpt"):
        if last.is_file():
            rank_zero_info(f"--ckpt_path {path} is a folder: resuming from its {last.relative_to(path)}.")
            return last
    held = sorted(str(p.relative_to(path)) for p in (*path.glob("*.ckpt"), *path.glob("checkpoints/*.ckpt")))
    raise CheckpointError(f"--ckpt_path '{path}' is a folder, not a checkpoint file, and it holds no "
                          f"checkpoints/last.ckpt. " + (f"Pass one of its checkpoints: {', '.join(held)}." if held else
                          "Pass a .ckpt file, a run folder holding checkpoints/last.ckpt, or --ckpt_path last."))


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's metadata (memory-mapped: the tensors are not read)."""
    if not path.is_file():
        raise CheckpointError(f"Checkpoint '{path}' does not exist. Pass an existing .ckpt file, or --ckpt_path last "
                              "to continue the newest run of this config.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # truncated, corrupt, or not a checkpoint
        others = sorted(p.name for p in path.parent.glob("*.ckpt") if p.name != path.name)
        where = (f"Other checkpoints in {path.parent}: {', '.join(others)}; pass one of them as --ckpt_path."
                 if others else f"{path.parent} holds no other checkpoint: start a new run without --ckpt_path (the "
                 "run's hf_model folder, if written, can be --model.model_name_or_path).")
        raise CheckpointError(f"Checkpoint '{path}' ({path.stat().st_size} bytes) cannot be read: "
                              f"{type(err).__name__}: {str(err)[:200]}. It is truncated, corrupt or not a Lightning "
                              f"checkpoint. {where}") from err


# Knobs that make the reference a model the run rewrites (BEMA, TR-DPO's sync), its state in the checkpoint
REFERENCE_SWITCHES = ("update_ref_model", "sync_ref_model")


def check_resume(checkpoint: dict[str, Any], path: Path, trainer: L.Trainer, module: L.LightningModule,
                 datamodule: Any) -> list[str]:
    """Refuse a checkpoint that belongs to another run than the config describes; return warnings to print.

    Compared: the method, the model and tokenizer, the batch layout (batch size, accumulation, world size: the
    position in the epoch is counted in batches), whether the reference is rewritten (``REFERENCE_SWITCHES``),
    ``max_steps`` against the checkpoint's step; the data file only
    warns (a changed file is sometimes intended).
    """
    now = checkpoint_facts(trainer, module, datamodule, None)
    then = dict(checkpoint.get(CHECKPOINT_FACTS_KEY) or {})
    then.setdefault("method", (checkpoint.get("lightalign_meta") or {}).get("module"))
    then.setdefault("model_name_or_path", _plain((checkpoint.get("hyper_parameters") or {}).get("model_name_or_path")))
    fresh = "To start a new run from its weights instead, pass that run's hf_model folder as --model.model_name_or_path " \
            "without --ckpt_path."
    for key, label in (("method", "method"), ("model_name_or_path", "model"), ("tokenizer", "tokenizer")):
        if then.get(key) is not None and now[key] is not None and not _same(then[key], now[key]):
            raise ResumeError(f"Checkpoint '{path}' was written with {label} {then[key]!r}, but the config has "
                              f"{now[key]!r}: a run resumes with the {label} that wrote it. Use the config of that "
                              f"run (config.yaml beside its checkpoints). {fresh}")
    for key, label in (("batch_size", "--data.batch_size"), ("accumulate_grad_batches", "--trainer.accumulate_grad_batches"),
                       ("world_size", "the number of processes (devices x num_nodes)")):
        if then.get(key) is not None and then[key] != now[key]:
            raise ResumeError(f"Checkpoint '{path}' was written with {label} = {then[key]}, the config has {now[key]}: "
                              "the position inside the epoch is counted in batches of the old layout, so rows would be "
                              f"skipped or repeated. Resume with {then[key]}. {fresh}")
    saved, given = checkpoint.get("hyper_parameters") or {}, getattr(module, "hparams", {})
    for key in REFERENCE_SWITCHES:  # a reference the checkpoint rewrote, resumed as a fixed one (or the reverse)
        if key in saved and key in given and bool(saved[key]) != bool(given[key]):
            raise ResumeError(f"Checkpoint '{path}' was written with {key}: {str(bool(saved[key])).lower()}, the "
                              f"config has {str(bool(given[key])).lower()}: the reference the run trains against "
                              f"(and its state kept in the checkpoint) would change. Resume with --model.{key} "
                              f"{str(bool(saved[key])).lower()}. {fresh}")
    step, max_steps = int(checkpoint.get("global_step", 0)), trainer.max_steps
    if max_steps is not None and 0 <= max_steps < step:
        raise ResumeError(f"Checkpoint '{path}' is at step {step}, past --trainer.max_steps {max_steps}: nothing to "
                          f"train. Raise --trainer.max_steps above {step} to train further.")
    warnings = []
    if then.get("data_path") is not None and now["data_path"] is not None and (
            not _same(then["data_path"], now["data_path"]) or then.get("data_size") != now["data_size"]):
        warnings.append(f"Checkpoint '{path}' was trained on {then['data_path']!r} ({then.get('data_size')} bytes); the "
                        f"config reads {now['data_path']!r} ({now['data_size']} bytes). Resuming on the new data at the "
                        "old position inside the epoch.")
    return warnings


def _plain(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else (str(value) if isinstance(value, os.PathLike) else None)


def _file_size(path: Any) -> int | None:
    return os.path.getsize(path) if isinstance(path, (str, os.PathLike)) and os.path.isfile(path) else None


def _same(a: str, b: str) -> bool:
    """The same name, or two spellings (relative, absolute) of the same local path."""
    return a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))
