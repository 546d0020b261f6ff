"""Peak RSS of an SFT fit in one precision, step by step: where a bf16 run's memory goes on the CPU.

    OMP_NUM_THREADS=1 python bench/bf16_memory.py bf16-mixed [--steps 40] [--no-autocast-cache] [--keep-weight-casts]
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 LRU_CACHE_CAPACITY=1024 OMP_NUM_THREADS=1 python bench/bf16_memory.py bf16-mixed

The `small` model (30.4M parameters) from its config on examples/data/chat_sft.jsonl, batch 8, max_length 256, one
thread. Prints the process's peak RSS (``resource.getrusage``) at train start and after every step, wall and CPU
seconds. ``--no-autocast-cache`` runs Lightning's bf16 autocast with ``cache_enabled=False``; the two environment
variables set oneDNN's and ideep's primitive caches to the libraries' default instead of lightalign's bound
(``bound_onednn_caches`` leaves a set variable alone). ``--keep-weight-casts`` runs without
``recast_saved_weights`` (autograd keeps the weights' bf16 casts for the backward pass, as before it). Memory figures hold on a loaded machine; times do not.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import lightning as L
import torch

from lightalign import SFTDataModule, SFTModule

ROOT = Path(__file__).resolve().parents[1]


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Peaks(L.Callback):
    def __init__(self) -> None:
        self.start, self.steps, self.t0 = 0.0, [], 0.0

    def on_train_start(self, trainer, pl_module):
        self.start, self.t0 = peak_mib(), time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.steps.append(round(peak_mib()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("precision", choices=["32-true", "bf16-mixed", "bf16-true"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model", default=str(ROOT / "assets/models/small"))
    parser.add_argument("--no-autocast-cache", action="store_true")
    parser.add_argument("--keep-weight-casts", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.no_autocast_cache:
        from lightning.pytorch.plugins.precision import MixedPrecision

        MixedPrecision.autocast_context_manager = lambda self: torch.autocast(
            self.device, dtype=torch.bfloat16, cache_enabled=False)
    if args.keep_weight_casts:
        from lightalign.modules.training import recast_weights

        recast_weights.recasts_weights = lambda *_: False
    L.seed_everything(0)
    module = SFTModule(args.model, from_config=True)
    data = SFTDataModule(str(ROOT / "examples/data/chat_sft.jsonl"), tokenizer=args.model, batch_size=8,
                         max_length=256)
    peaks = Peaks()
    L.Trainer(accelerator="cpu", precision=args.precision, max_steps=args.steps, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=[peaks]).fit(module, data)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    params = sum(p.numel() for p in module.parameters())
    print(f"{args.precision}: {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MiB fp32); peak RSS MiB at "
          f"train start {peaks.start:.0f}, per step {peaks.steps}, final {peak_mib():.0f}; "
          f"{time.perf_counter() - peaks.t0:.1f} s wall, {usage.ru_utime:.1f} s CPU")


if __name__ == "__main__":
    main()
