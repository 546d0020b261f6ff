"""Multi-node launch checks and rank-aware logging.

``check_multinode_env``: with ``num_nodes > 1`` and a plain launch (no torchrun, no SLURM), every node needs
``MASTER_ADDR``, ``MASTER_PORT`` and ``NODE_RANK``; without them Lightning picks a local address, a random port
or node 0 and the processes wait for each other forever. This turns that hang into an immediate error.
(``WORLD_SIZE`` is not read: Lightning computes it from ``--trainer.num_nodes`` x ``--trainer.devices``.)

``RankLogging``: the main process logs at ``log_level``, the others at ``log_level_replica``; with
``log_on_each_node`` the main process of every node counts as main (the transformers Trainer's knobs).
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

import lightning as L

REQUIRED = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


def launched_by_torchrun_or_slurm(environ: Mapping[str, str]) -> bool:
    return "TORCHELASTIC_RUN_ID" in environ or ("SLURM_NTASKS" in environ and "SLURM_JOB_NAME" in environ
                                                 and environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"))


def check_multinode_env(num_nodes: int, environ: Mapping[str, str] | None = None) -> None:
    """Raise ``RuntimeError`` before any process group exists if a multi-node plain launch lacks its variables."""
    environ = os.environ if environ is None else environ
    if num_nodes <= 1 or launched_by_torchrun_or_slurm(environ):
        return
    missing = [name for name in REQUIRED if not environ.get(name)]
    if missing:
        raise RuntimeError(
            f"num_nodes={num_nodes} but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: the "
            "processes would wait for each other forever. On every node export MASTER_ADDR (the address of node 0), "
            "MASTER_PORT (the same free port everywhere) and NODE_RANK (0..num_nodes-1), or launch with torchrun "
            "(--nnodes, --node-rank, --master-addr, --master-port) or SLURM (srun)."
        )
    node_rank = environ["NODE_RANK"]
    if not node_rank.isdigit() or int(node_rank) >= num_nodes:
        raise RuntimeError(f"NODE_RANK={node_rank!r} must be an integer in 0..{num_nodes - 1} (num_nodes={num_nodes}).")
    port = environ["MASTER_PORT"]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RuntimeError(f"MASTER_PORT={port!r} is not a TCP port number.")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_processes_note(accelerator: str, devices: int, cores: int | None = None) -> str | None:
    """What ``--trainer.devices N`` means on CPU when N exceeds the cores (None otherwise): Lightning's CPU "devices"
    are processes (DDP over gloo), each with a full copy of the model and its own batches, whatever the cores."""
    cores = usable_cores() if cores is None else cores
    if accelerator != "cpu" or devices <= cores:
        return None
    return (f"--trainer.devices {devices} on CPU starts {devices} training processes (DDP over gloo), each holding a "
            f"full copy of the model and training its own batches (effective batch x{devices}), on {cores} CPU "
            f"core(s): they share the cores, so this is slower than --trainer.devices {cores}, not faster.")


LOGGERS = ("lightalign", "lightning.pytorch", "lightning.fabric", "transformers", "datasets")
# Libraries whose INFO messages are their own chatter (transformers dumps the model config at every load and names
# every file it saves): at ``log_level info`` they stay at WARNING; ``debug`` shows them.
CHATTY = ("transformers", "datasets")


def _level(name: str | int) -> int:
    if isinstance(name, int):
        return name
    value = logging.getLevelName(str(name).upper())
    if not isinstance(value, int):
        raise ValueError(f"Unknown log level '{name}'; use debug, info, warning, error or critical.")
    return value


class RankLogging(L.Callback):
    """Log levels per rank (``--logging.log_level info --logging.log_level_replica warning``).

    Args:
        log_level: level of the main process (``debug`` | ``info`` | ``warning`` | ``error`` | ``critical``);
            transformers and datasets log at ``warning`` or above unless it is ``debug`` (their INFO messages are
            the model config of every load and every file saved).
        log_level_replica: level of every other process.
        log_on_each_node: True: the first process of each node is a main process; False: only global rank 0.

    The levels hold from ``setup`` to ``teardown``, which restores the ones before (a Python program that fits keeps
    its own logging configuration afterwards).
    """

    def __init__(self, log_level: str = "info", log_level_replica: str = "warning", log_on_each_node: bool = True) -> None:
        self.log_level, self.log_level_replica = _level(log_level), _level(log_level_replica)
        self.log_on_each_node = log_on_each_node
        self._saved: dict[str, int] | None = None  # the levels before setup, put back at teardown

    def is_main(self, trainer: L.Trainer) -> bool:
        return trainer.local_rank == 0 if self.log_on_each_node else trainer.global_rank == 0

    def level_for(self, trainer: L.Trainer) -> int:
        return self.log_level if self.is_main(trainer) else self.log_level_replica

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        level = self.level_for(trainer)
        if self._saved is None:
            self._saved = {name: logging.getLogger(name).level for name in LOGGERS}
        for name in LOGGERS:
            logging.getLogger(name).setLevel(max(level, logging.WARNING) if name in CHATTY and level > logging.DEBUG
                                             else level)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        saved, self._saved = self._saved, None
        for name, level in (saved or {}).items():
            logging.getLogger(name).setLevel(level)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "")  # Lightning calls no teardown hook after an exception
