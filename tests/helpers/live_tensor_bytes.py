"""Bytes of live tensor storage, counted op by op: a memory measure that does not depend on the allocator, the heap
or the machine (unlike RSS).

``LiveTensorBytes`` is a ``TorchDispatchMode``: every ATen op that runs while it is entered (autocast's casts,
autograd's backward ops and the optimizer's included: the mode sits below autocast and autograd) has its output
storages recorded, with their sizes, as weak references; after each op the expired ones are dropped, so ``live`` is
the bytes of the storages created since entering that are still alive (an output that shares an input's
storage, a view or an in-place result, is no new storage) and ``peak`` the most of it seen after any op.
Storages that existed before entering (the model's parameters) are not counted: compare two runs of the same model.
Memory that oneDNN or a library allocates outside tensors is not seen.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _strided(leaves):
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"]


class LiveTensorBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in _strided(tree_leaves((args, kwargs)))}
        out = func(*args, **kwargs)
        for t in _strided(tree_leaves(out)):
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref.cdata not in inputs or ref.cdata in self.storages:  # new, or counted already (resized: out=)
                self.storages[ref.cdata] = (ref, storage.nbytes())
        self.sweep()
        return out

    def sweep(self) -> int:
        self.storages = {k: v for k, v in self.storages.items() if not v[0].expired()}
        self.live = sum(n for _, n in self.storages.values())
        self.peak = max(self.peak, self.live)
        return self.live


class StepBytes(L.Callback):
    """Live tensor bytes of a fit, step by step (``LiveTensorBytes`` entered from the fit's setup, before the module's, to its teardown): at
    each step's start and end (between steps), before its backward (what the forward keeps for it) and the step's
    peak."""

    def __init__(self) -> None:
        self.mode = LiveTensorBytes()
        self.start: list[int] = []
        self.before_backward: list[int] = []
        self.end: list[int] = []
        self.peak: list[int] = []

    def setup(self, trainer, pl_module, stage):  # before the module's own setup: what it allocates is counted
        self.mode.__enter__()

    def teardown(self, trainer, pl_module, stage):
        self.mode.__exit__(None, None, None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start.append(self.mode.sweep())
        self.mode.peak = self.mode.live

    def on_before_backward(self, trainer, pl_module, loss):
        self.before_backward.append(self.mode.sweep())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end.append(self.mode.sweep())
        self.peak.append(self.mode.peak)
