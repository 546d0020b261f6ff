"""SFT throughput and peak memory: padding vs padding-free vs packing, on the `small` config (~30M params).

Run by hand from the repository root:   python bench/sft.py [--steps 20] [--model assets/models/small]
Each setting runs in its own process (peak RSS is per process) and prints one line; a table closes the run.
Tokens/s counts the non-padding tokens trained, measured after --warmup optimizer steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "padding": {},
    "padding_free": {"padding_free": True},
    "packing": {"packing": True},
}


def run_one(args: argparse.Namespace, setting: str) -> dict:
    import lightning as L
    import torch

    from lightalign import SFTDataModule, SFTModule
    from lightalign.callbacks.throughput import batch_tokens

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.tokens = 0
            self.start = None
            self.steps = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == args.warmup and self.start is None:
                self.start = time.perf_counter()
                return
            if self.start is not None:
                self.tokens += batch_tokens(batch)
                self.steps = trainer.global_step - args.warmup

    L.seed_everything(0)
    torch.set_num_threads(args.threads)
    module = SFTModule(args.model, from_config=True, learning_rate=1e-4)
    data = SFTDataModule(args.data, tokenizer=args.model, max_length=args.max_length, batch_size=args.batch_size,
                         **SETTINGS[setting])
    clock = Clock()
    trainer = L.Trainer(accelerator="cpu", max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
                        limit_val_batches=0)
    trainer.fit(module, data)
    elapsed = time.perf_counter() - clock.start
    n_params = sum(p.numel() for p in module.model.parameters())
    return {
        "setting": setting,
        "tokens_per_sec": clock.tokens / elapsed,
        "steps": clock.steps,
        "seconds": elapsed,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params_m": n_params / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "assets" / "models" / "small"))
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "chat_sft.jsonl"))
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        print("RESULT " + json.dumps(run_one(args, args.one)), flush=True)
        return

    print(f"model={args.model} data={Path(args.data).name} max_length={args.max_length} batch={args.batch_size} "
          f"steps={args.steps} (+{args.warmup} warmup) threads={args.threads} precision=fp32")
    results = []
    for setting in args.settings:
        cmd = [sys.executable, __file__, "--one", setting] + [
            a for a in sys.argv[1:] if a != "--settings" and a not in args.settings
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{setting}: failed\n{out.stderr[-2000:]}")
            continue
        res = json.loads(line[len("RESULT "):])
        results.append(res)
        print(f"{setting:>13}: {res['tokens_per_sec']:8.0f} tokens/s  peak RSS {res['peak_rss_mb']:6.0f} MB")
    print(f"\n| setting | tokens/s | vs padding | peak RSS (MB) |\n|---|---|---|---|")
    base = next((r["tokens_per_sec"] for r in results if r["setting"] == "padding"), None)
    for r in results:
        ratio = f"{r['tokens_per_sec'] / base:.2f}x" if base else "-"
        print(f"| {r['setting']} | {r['tokens_per_sec']:.0f} | {ratio} | {r['peak_rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
