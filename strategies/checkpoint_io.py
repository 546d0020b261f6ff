"""``AtomicCheckpointIO``: checkpoints written to a temporary file and renamed into place, with clear errors.

A crash (or SIGKILL) during a save leaves the previous checkpoint under its name untouched; a full disk raises an
error that says so; a truncated or corrupt file fails to load with a message naming it instead of a zip-reader
stack trace. The CLI installs it by default; from Python pass ``L.Trainer(plugins=[AtomicCheckpointIO()])``.

The temporary file is ``.<name>.tmp-<host>-<pid>``; a save killed midway leaves it behind (as large as a
checkpoint), so every save and load first deletes those of this folder whose process, on this host, is gone.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import socket
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file and what to do."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with atomic, fsync'ed writes and readable load errors."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)
        tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except BaseException as err:
            tmp.unlink(missing_ok=True)
            if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(path.parent).free / 2**20
                raise CheckpointError(
                    f"Out of disk space while writing checkpoint '{path}' ({free:.0f} MB free there). The previous "
                    "checkpoint is untouched. Free some space or set checkpoint.dirpath to another disk, then resume "
                    "with --ckpt_path last."
                ) from err
            raise

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"Checkpoint '{path}' does not exist.")
        remove_stale_temporaries(path.parent)
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as err:
            text = str(err)
            if "weights_only" in text or "Unsupported global" in text:
                raise CheckpointError(
                    f"Checkpoint '{path}' holds Python objects that safe loading (weights_only=True) refuses: {text[:300]}. "
                    "Load it with weights_only=False only if you trust where it came from."
                ) from err
            raise CheckpointError(
                f"Checkpoint '{path}' ({path.stat().st_size} bytes) cannot be read: it is truncated or corrupt "
                f"({type(err).__name__}: {text[:200]}). Resume from an earlier checkpoint of the same run."
            ) from err


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Delete the temporary files of killed saves in ``directory``: ``.<name>.tmp-<host>-<pid>`` of this host whose
    process no longer runs (and ``.<name>.tmp-<pid>``, the older name). Files of live processes, of other hosts
    (a shared filesystem) and anything else are left alone. Returns what was deleted."""
    host, removed = socket.gethostname(), []
    for tmp in directory.glob(".*.tmp-*"):
        owner = tmp.name.rpartition(".tmp-")[2]
        file_host, _, pid = owner.rpartition("-")
        if not tmp.is_file() or not pid.isdigit() or file_host not in ("", host) or int(pid) == os.getpid() or _process_alive(int(pid)):
            continue
        try:
            tmp.unlink()
            removed.append(tmp)
        except OSError:
            pass  # another process cleaned it up first, or no permission: not ours to insist on
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
