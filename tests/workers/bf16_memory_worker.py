"""Peak resident memory of training steps on new matrix shapes, for tests/training/test_bf16_memory.py.

``python bf16_memory_worker.py MODEL_DIR PRECISION STEPS [--library-default]`` runs a PolicyModule's ``setup`` as a CPU fit in PRECISION
does (its side effects: for bf16, ``bound_onednn_caches``), then STEPS training steps of a stack of linear layers whose
weights dominate memory, in Lightning's forward context for PRECISION (``MixedPrecision``'s autocast for
``bf16-mixed``), each on a new number of rows (a new shape per step, as padding-free batches give), with Adam. It
prints one JSON line: the parameter bytes and the process's peak RSS (``resource.getrusage``, bytes) after the first
step and at the end. ``--library-default`` first sets oneDNN's and ideep's cache capacities to the libraries' own
default (1024), as a user's environment may: ``bound_onednn_caches`` then leaves them alone (the unbounded control)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
from types import SimpleNamespace

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightalign import SFTModule
from lightalign.modules.training.cpu_bf16 import CACHE_VARIABLES


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    model_dir, precision, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    if "--library-default" in sys.argv:
        os.environ.update(dict.fromkeys(CACHE_VARIABLES, "1024"))
    torch.manual_seed(0)
    module = SFTModule(model_dir, from_config=True, retain_cpu_memory=False)
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), precision=precision)
    module.setup("fit")  # what a fit does first: the run's side effects for this precision and device
    layers = torch.nn.Sequential(torch.nn.Linear(512, 1920, bias=False), torch.nn.Linear(1920, 512, bias=False))
    optimizer = torch.optim.Adam(layers.parameters(), lr=1e-4)
    context = MixedPrecision(precision, "cpu").forward_context if "mixed" in precision else contextlib.nullcontext
    first = None
    for step in range(steps):
        x = torch.randn(1000 + 7 * step, 512)
        with context():
            loss = layers(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        first = first or peak_bytes()
    module.teardown("fit")
    print(json.dumps({"param_bytes": sum(p.numel() * 4 for p in layers.parameters()), "first": first,
                      "peak": peak_bytes()}))


if __name__ == "__main__":
    main()
