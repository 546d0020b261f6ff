"""``fork_ranks(devices)``: a test worker's other local ranks as forks of its own process, started before any fit.

Lightning's launcher starts each other rank as ``python script args`` again, a process that imports torch, Lightning,
transformers (and DeepSpeed) once more: several seconds of CPU per rank and launch. A worker forked from the tests'
console server (tests/helpers/console_script.py) has all of them imported already, so its ranks are forked from it
instead, each with the environment Lightning's launcher gives its children (``LOCAL_RANK``, ``NODE_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``): Lightning then takes the processes as launched from outside (as under
torchrun) and every ``Trainer.fit`` of the worker runs in them. As with Lightning's launcher, a rank that fails stops
the others: rank 0 exits with status 1 when another rank exits with an error, and its children are killed when
rank 0 raises.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def fork_ranks(devices: int, num_nodes: int = 1) -> int:
    """Fork local ranks 1..devices-1 of this node; returns this process's local rank. No-op (0) for one device or
    when the ranks were launched from outside (``LOCAL_RANK`` set)."""
    if devices <= 1 or "LOCAL_RANK" in os.environ:
        return int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", _free_port())
    os.environ.setdefault("NODE_RANK", "0")
    os.environ["WORLD_SIZE"] = str(devices * num_nodes)
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    for rank in range(1, devices):
        pid = os.fork()
        if pid == 0:
            os.environ["LOCAL_RANK"] = str(rank)
            return rank
        children.append(pid)
    os.environ["LOCAL_RANK"] = "0"

    def watch(pid: int) -> None:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            print(f"rank process {pid} exited with status {code}: stopping rank 0", file=sys.stderr, flush=True)
            os._exit(1)

    watchers = [threading.Thread(target=watch, args=(pid,), daemon=True) for pid in children]
    for thread in watchers:
        thread.start()

    def finish() -> None:
        """At rank 0's exit: wait for the other ranks (their failures exit from ``watch``); after an uncaught
        exception of rank 0 (it would leave them waiting in a collective) kill them first."""
        if getattr(sys, "last_value", None) is not None or _raised:
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for thread in watchers:
            thread.join()

    _raised.clear()
    hook = sys.excepthook

    def excepthook(*exc) -> None:
        _raised.append(exc[0])
        hook(*exc)

    sys.excepthook = excepthook
    atexit.register(finish)
    return 0


_raised: list = []
