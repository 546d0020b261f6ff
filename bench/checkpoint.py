"""Cost of checkpointing: SFT on the `small` config (~30M params) with and without a checkpoint every k steps.

Run by hand from the repository root:   python bench/checkpoint.py [--steps 20] [--every 5]
Prints wall time per setting, the overhead per checkpoint and the checkpoint size (weights + AdamW state).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightalign import AtomicCheckpointIO, SFTDataModule, SFTModule

ROOT = Path(__file__).resolve().parent.parent


def run(steps: int, every: int | None, out: Path) -> float:
    L.seed_everything(0)
    model = str(ROOT / "assets" / "models" / "small")
    module = SFTModule(model, from_config=True, learning_rate=1e-4)
    data = SFTDataModule(str(ROOT / "examples" / "data" / "chat_sft.jsonl"), tokenizer=model, batch_size=8, max_length=128)
    callbacks = [ModelCheckpoint(dirpath=out, every_n_train_steps=every, save_last=True, save_top_k=0)] if every else []
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(every), callbacks=callbacks,
                        plugins=[AtomicCheckpointIO()], limit_val_batches=0)
    start = time.perf_counter()
    trainer.fit(module, data)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        base = run(args.steps, None, Path(tmp) / "none")
        with_ckpt = run(args.steps, args.every, Path(tmp) / "ckpt")
        size = (Path(tmp) / "ckpt" / "last.ckpt").stat().st_size / 2**20
    n = args.steps // args.every
    print(f"{args.steps} steps without checkpoints: {base:.1f} s; with one every {args.every} steps ({n} saves): "
          f"{with_ckpt:.1f} s; overhead {100 * (with_ckpt - base) / base:.1f}% = {(with_ckpt - base) / n:.2f} s per "
          f"checkpoint of {size:.0f} MB")


if __name__ == "__main__":
    main()
