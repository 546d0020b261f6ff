"""One owner per run folder: ``RunLock``, the claim a run holds on its folder for as long as it writes there.

Two processes writing one run folder lose data (Lightning's CSV logger deletes an existing ``metrics.csv`` when it
starts, the two ``config.yaml`` and checkpoints overwrite each other, a double ``--ckpt_path last`` trains the same
steps twice). So the process that writes a run folder (global rank 0: the owner is the run, not each rank) claims it
first, before anything is written into it, and a second claim is refused in one line naming the holder.

The claim is the file ``.<run folder's name>.lock`` beside the run folder (``runs/x/.version_0.lock``: outside it, so
claiming writes nothing into the folder, and Lightning's loggers, which warn about a non-empty new folder, see none):

* held with ``fcntl.flock(LOCK_EX | LOCK_NB)`` on a descriptor kept open for the life of the run: the kernel releases
  it when the process ends however it ends (``kill -9``), so on one host a dead owner is never mistaken for a live
  one and nothing has to be guessed from pids;
* holding the owner's record (pid, host, start time, command) for the refusal message, and refreshed (its mtime)
  every ``HEARTBEAT_S`` seconds by a daemon thread;
* removed when the run ends (also on an exception). A killed run leaves it behind: the next claim takes the free
  lock and says whose it was.

``flock`` across hosts: on NFSv4 (Linux client) it is a lock on the server, and a crashed client's locks are dropped
after the server's lease time (about 90 s). Some shared file systems only lock per host (NFS mounted ``nolock`` or
``local_lock=flock``, Lustre with ``localflock``), or refuse ``flock`` (Lustre without ``flock``: then only the record
is used, see below). So a claim that gets the lock but finds the record of a process on *another* host does not trust
the lock alone: that owner is alive if its record's mtime advances; it is taken over once the record has not been
refreshed for ``STALE_AFTER_S`` seconds (the claim waits for that, up to ``STALE_AFTER_S``, and says so). To take a
folder over at once, delete the lock file (the refusal names it). On one host the lock decides; where ``flock`` is
not available the record decides: a pid that is gone is stale (same host), as is a record past ``STALE_AFTER_S``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from lightalign.runs import RunError

HEARTBEAT_S = 30.0  # how often the owner refreshes its record's mtime
STALE_AFTER_S = 120.0  # another host's record not refreshed for this long: its run is gone
_HELD: set[int] = set()  # descriptors of the locks this process holds (closed in forked children, see _forked)


class RunInUseError(RunError):
    """A run folder another live run owns; ``holder`` is its record (pid, host, since), ``{}`` if unreadable."""

    def __init__(self, message: str, holder: dict[str, Any]) -> None:
        super().__init__(message)
        self.holder = holder


def _forked() -> None:
    # A forked child (a DataLoader worker) shares the parent's lock; closing its copy (without LOCK_UN) keeps the
    # lock the parent's alone, so it is released when the parent ends, not when the last worker does.
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def lock_path(folder: Path) -> Path:
    """The lock file of run folder ``folder``: ``.<name>.lock`` beside it (``version_*`` globs do not match it)."""
    return folder.parent / f".{folder.name}.lock"


def owner_record() -> dict[str, Any]:
    """This process as a lock's owner: pid, host, start time (local, ISO, seconds) and the command line."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.now().astimezone().isoformat(timespec="seconds"), "command": " ".join(sys.argv)}


def describe(holder: dict[str, Any]) -> str:
    """``pid 123 on host h since 2025-01-02T03:04:05+00:00`` (what the refusal names)."""
    if not holder.get("pid"):
        return "a run that has not recorded itself yet"
    return f"pid {holder['pid']} on host {holder.get('host', '?')} since {holder.get('since', '?')}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class RunLock:
    """The claim on one run folder (see the module docstring). ``RunLock.acquire(folder)`` returns the held lock or
    raises ``RunInUseError``; ``release()`` gives it back (idempotent). ``previous`` is the record of a dead owner
    this claim took over (None: the folder was free)."""

    def __init__(self, folder: Path, fd: int, previous: dict[str, Any] | None, flocked: bool) -> None:
        self.folder, self.path, self.previous, self.flocked = folder, lock_path(folder), previous, flocked
        self._fd: int | None = fd
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="lightalign-run-lock", daemon=True)
        self._beat.start()

    @classmethod
    def acquire(cls, folder: Path | str, *, wait: Callable[[float], None] = time.sleep,
                info: Callable[[str], None] = lambda msg: None) -> "RunLock":
        """Claim ``folder`` (created if missing) for this process; ``info`` is told about a take-over or a wait."""
        folder = Path(folder)
        path = lock_path(folder)
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            flocked = True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise RunInUseError(refusal(folder, holder), holder) from None
            except OSError as err:
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise
                flocked = False  # no flock on this file system: the record alone decides
            try:  # the lock is on the file the path names still (not one a releasing owner just unlinked)
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            previous = _read(fd)
            if previous and not owner_gone(previous, folder, flocked, wait, info):
                raise RunInUseError(refusal(folder, previous), previous)
            _write(fd, owner_record())
        except BaseException:
            os.close(fd)  # the lock, not the file: the live owner's record stays
            raise
        if previous:
            info(f"Run folder {folder}: taking it over from {describe(previous)}, which is gone (its lock file was "
                 "left behind).")
        _HELD.add(fd)
        return cls(folder, fd, previous or None, flocked)

    def release(self) -> None:
        """Remove the lock file and drop the lock (the file first: a claim that got the old file retries)."""
        if self._fd is None:
            return
        self._stop.set()
        fd, self._fd = self._fd, None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                os.unlink(self.path)
        except OSError:
            pass
        _HELD.discard(fd)
        os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            fd = self._fd
            if fd is None:
                return
            try:
                os.utime(fd)
            except OSError:
                pass


def owner_gone(holder: dict[str, Any], folder: Path, flocked: bool, wait: Callable[[float], None],
               info: Callable[[str], None]) -> bool:
    """Whether the owner a lock file records is gone, for a claim that got the lock (``flocked``) or has no flock.

    Same host: with flock, yes (a live owner would hold the lock); without, when its pid is gone. Another host: when
    its record has not been refreshed for ``STALE_AFTER_S`` (waited for, up to that long: it advances while the owner
    lives)."""
    if holder.get("host") == socket.gethostname():
        return True if flocked else not pid_alive(int(holder.get("pid") or 0))
    path = lock_path(folder)
    first = _mtime(path)
    if time.time() - first < STALE_AFTER_S:
        info(f"Run folder {folder}: its lock file names {describe(holder)}; waiting up to {STALE_AFTER_S:.0f} s "
             "to see whether that run is alive (it refreshes the file while it runs).")
    while time.time() - _mtime(path) < STALE_AFTER_S:
        if _mtime(path) != first:
            return False
        wait(1.0)
    return True


def refusal(folder: Path, holder: dict[str, Any]) -> str:
    """The one-line refusal of a second run targeting ``folder``."""
    return (f"Run folder {folder} is in use by another run: {describe(holder)}. Two runs in one folder would mix "
            "their metrics, config and checkpoints: wait for that run to end or stop it (a new run without "
            "--trainer.logger.init_args.version takes a version_N of its own). If it is gone (its node was lost), the "
            f"folder is taken over once its lock file has not been refreshed for {STALE_AFTER_S:.0f} s, or at once "
            f"after you delete {lock_path(folder)}.")


def _read(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 1 << 16, 0)
        record = json.loads(data.decode()) if data.strip() else {}
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(fd: int, record: dict[str, Any]) -> None:
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
