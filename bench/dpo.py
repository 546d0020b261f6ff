"""DPO throughput and peak memory: lightalign's DPOModule vs TRL's DPOTrainer, same model, data and settings.

Run by hand from the repository root, in a separate venv so TRL never enters the dev venv:

    python3 -m venv /work/benchvenv && /work/benchvenv/bin/pip install torch==2.13.0
    /work/benchvenv/bin/pip install -e '.[bench]'
    /work/benchvenv/bin/python bench/dpo.py [--data examples/data/arithmetic_preference.jsonl] [--repeats 3]

The `small` config (~30M params) is built once under a fixed seed and saved to a temporary folder; both frameworks
load that folder (same weights). Two modes: `online` (a frozen reference model forwards every batch) and
`precomputed` (`precompute_ref_log_probs=True`: one reference pass before training, timed separately). Every
(framework, mode) runs in its own process (peak RSS = ru_maxrss of that process), frameworks alternating; pairs/s
counts the pairs of the --steps optimizer steps after --warmup steps, timed from step end to step end by a callback
(Lightning `on_train_batch_end`, transformers `on_step_end`). Each process gets fresh dataset and log-prob caches.
Results: a table on stdout and JSON in bench/results/dpo.json (medians over --repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("lightalign", "trl")
MODES = ("online", "precomputed")


class Meter:
    """Times optimizer steps warmup+1 .. warmup+steps and sums the pairs/tokens of their batches."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.last = warmup, warmup + steps
        self.start = self.end = self.prev = None
        self.pairs = self.tokens = 0
        self.step_seconds: list[float] = []
        self.batch_stats = (0, 0, float("nan"))
        self.loss = float("nan")
        self.threads = 0

    def batch(self, pairs: int, tokens: int, loss) -> None:
        """Called once per micro-batch with its pair count, the non-padding tokens computed, and its loss."""
        self.batch_stats = (pairs, tokens, float(loss))

    def step_end(self, step: int) -> None:
        """Called after optimizer step ``step`` (1-based) is done."""
        import torch

        now = time.perf_counter()
        if step == self.warmup:
            self.start = self.prev = now
        elif self.start is not None and step <= self.last:
            pairs, tokens, self.loss = self.batch_stats
            self.pairs, self.tokens = self.pairs + pairs, self.tokens + tokens
            self.step_seconds.append(now - self.prev)
            self.prev = now
            if step == self.last:
                self.end = now
                self.threads = torch.get_num_threads()


def build_model(model_config_dir: str, out_dir: Path, seed: int) -> int:
    """Random weights from the config under a fixed seed, saved with the tokenizer files; returns the param count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(model_config_dir, out_dir)  # tokenizer + chat template + config
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_config_dir), dtype=torch.float32)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def run_lightalign(args: argparse.Namespace, precompute: bool, meter: Meter, workdir: Path) -> dict:
    import lightning as L

    from lightalign import DPOModule, PreferenceDataModule

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            meter.batch(pl_module.last_batch_samples, pl_module.last_batch_tokens, outputs["loss"])
            meter.step_end(trainer.global_step)

    class TimedDPOModule(DPOModule):
        precompute_seconds = 0.0

        def precompute_reference(self, datamodule):
            start = time.perf_counter()
            super().precompute_reference(datamodule)
            self.precompute_seconds += time.perf_counter() - start

    L.seed_everything(args.seed, verbose=False)
    module = TimedDPOModule(args.model_dir, beta=args.beta, loss_type="sigmoid", learning_rate=args.lr,
                            lr_scheduler_type="constant", precompute_ref_log_probs=precompute,
                            ref_log_probs_cache_dir=str(workdir / "ref_logps"))
    data = PreferenceDataModule(args.data, tokenizer=args.model_dir, max_length=args.max_length,
                                max_prompt_length=None, truncation_mode="keep_start", batch_size=args.batch_size,
                                num_workers=0, shuffle=False, prompt_sharing=args.prompt_sharing == "on")
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="32-true", max_steps=meter.last,
                        accumulate_grad_batches=1, gradient_clip_val=args.max_grad_norm, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Clock()])
    trainer.fit(module, data)
    return {"precompute_seconds": module.precompute_seconds if precompute else None,
            "attn": module.model.config._attn_implementation}


def run_trl(args: argparse.Namespace, precompute: bool, meter: Meter, workdir: Path) -> dict:
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            meter.step_end(state.global_step)

    class TimedDPOTrainer(DPOTrainer):
        precompute_seconds = 0.0

        def _precompute_ref_logps(self, *a, **kw):  # called from __init__ (TRL 1.x)
            start = time.perf_counter()
            out = super()._precompute_ref_logps(*a, **kw)
            TimedDPOTrainer.precompute_seconds += time.perf_counter() - start
            return out

        def compute_loss(self, model, inputs, *a, **kw):
            loss = super().compute_loss(model, inputs, *a, **kw)
            if model.training:
                meter.batch(inputs["input_ids"].shape[0] // 2, int(inputs["attention_mask"].sum()), loss.detach())
            return loss

    config = DPOConfig(
        output_dir=str(workdir / "trl_out"), per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
        max_steps=meter.last, learning_rate=args.lr, lr_scheduler_type="constant", optim="adamw_torch",
        weight_decay=0.0, max_grad_norm=args.max_grad_norm, beta=args.beta, loss_type=["sigmoid"],
        max_length=args.max_length, truncation_mode="keep_start", precompute_ref_log_probs=precompute,
        bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, dataloader_num_workers=0,
        train_sampling_strategy="sequential", eval_strategy="no", save_strategy="no", report_to="none",
        disable_tqdm=True, logging_steps=10, seed=args.seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    dataset = load_dataset("json", data_files=args.data, split="train")
    trainer = TimedDPOTrainer(model=args.model_dir, args=config, train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[Clock()])
    trainer.train()
    return {"precompute_seconds": TimedDPOTrainer.precompute_seconds if precompute else None,
            "attn": trainer.model.config._attn_implementation}


def run_one(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix=f"dpo-{args.framework}-{args.mode}-", dir=args.workdir))
    os.environ["HF_DATASETS_CACHE"] = str(workdir / "datasets")  # no dataset/ref-logps cache hit across runs
    meter = Meter(args.warmup, args.steps)
    run = run_lightalign if args.framework == "lightalign" else run_trl
    extra = run(args, args.mode == "precomputed", meter, workdir)
    if meter.end is None:
        raise RuntimeError(f"training stopped before step {meter.last}: too few rows for the requested steps?")
    seconds = meter.end - meter.start
    return {"framework": args.framework, "mode": args.mode, "pairs_per_sec": meter.pairs / seconds,
            "tokens_per_sec": meter.tokens / seconds, "seconds": seconds, "pairs": meter.pairs,
            "tokens": meter.tokens, "last_loss": meter.loss, "threads": meter.threads,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "median_step_seconds": statistics.median(meter.step_seconds), "step_seconds": meter.step_seconds,
            "load_avg_1min": os.getloadavg()[0], **extra}


def wait_for_idle(max_load: float | None, timeout: float = 900.0) -> None:
    """On a shared machine: wait (up to ``timeout`` s) until the 1-minute load average drops below ``max_load``."""
    deadline = time.monotonic() + timeout
    while max_load is not None and os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(10)


def spawn(args: argparse.Namespace, framework: str, mode: str) -> dict | None:
    wait_for_idle(args.max_load)
    load_before = os.getloadavg()[0]
    cmd = [sys.executable, __file__, "--one", "--framework", framework, "--mode", mode, "--model-dir", args.model_dir,
           "--workdir", args.workdir, "--data", args.data, "--batch-size", str(args.batch_size), "--max-length",
           str(args.max_length), "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads",
           str(args.threads), "--lr", str(args.lr), "--beta", str(args.beta), "--max-grad-norm",
           str(args.max_grad_norm), "--seed", str(args.seed), "--prompt-sharing", args.prompt_sharing]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(args.threads), TQDM_DISABLE="1",
               HF_HUB_OFFLINE="1", WANDB_DISABLED="true", PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        print(f"{framework}/{mode}: failed (exit {out.returncode})\n{out.stderr[-3000:]}", flush=True)
        return None
    return {**json.loads(line[len("RESULT "):]), "load_avg_before": load_before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "assets" / "models" / "small"), help="config + tokenizer folder")
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "chat_preference.jsonl"))
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per step (per device, no accumulation)")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--prompt-sharing", default="on", choices=("on", "off"),
                        help="lightalign's shared-prompt pair layout (off: classic padded chosen/rejected rows)")
    parser.add_argument("--max-load", type=float, help="wait before each run until the 1-min load average is below")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--framework", "--mode", "--model-dir", "--workdir"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.data = str(Path(args.data).resolve())

    if args.one:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return

    import torch
    import transformers
    import trl

    args.workdir = tempfile.mkdtemp(prefix="bench-dpo-")
    try:
        args.model_dir = str(Path(args.workdir) / "model")
        n_params = build_model(args.model, Path(args.model_dir), args.seed)
        rows = sum(1 for line in open(args.data) if line.strip())
        if (args.warmup + args.steps) * args.batch_size > rows:
            parser.error(f"{args.data} has {rows} rows: fewer than (warmup + steps) x batch-size; lower --steps.")
        settings = {
            "model": f"{Path(args.model).name}: {n_params / 1e6:.1f}M params, seed {args.seed}, saved once, both load",
            "data": Path(args.data).name, "batch_pairs": args.batch_size, "grad_accum": 1,
            "max_length": args.max_length, "max_prompt_length": None, "truncation_mode": "keep_start",
            "precision": "fp32", "gradient_checkpointing": False, "optimizer": "torch AdamW (not fused), wd 0",
            "lr": args.lr, "lr_schedule": "constant", "max_grad_norm": args.max_grad_norm, "beta": args.beta,
            "loss_type": "sigmoid", "lightalign_prompt_sharing": args.prompt_sharing, "threads": args.threads, "dataloader_workers": 0, "data_order": "sequential",
            "warmup_steps": args.warmup, "timed_steps": args.steps, "repeats": args.repeats,
            "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}",
        }
        print("DPO benchmark: lightalign DPOModule vs TRL DPOTrainer")
        for key, value in settings.items():
            print(f"  {key}: {value}")
        print("  (TRL 1.x has no max_prompt_length, so lightalign gets None too. No eval, checkpoints or loggers.)\n"
              "  load = 1-min load average before -> after the run: above ~0.5 another process shares the 2 cores.\n",
              flush=True)

        runs = []
        for r in range(args.repeats):
            for mode in args.modes:
                for framework in FRAMEWORKS if r % 2 == 0 else FRAMEWORKS[::-1]:
                    res = spawn(args, framework, mode)
                    if res is None:
                        continue
                    runs.append(res)
                    pre = f"  precompute {res['precompute_seconds']:.1f} s" if res["precompute_seconds"] else ""
                    step = res["median_step_seconds"]
                    print(f"[{r + 1}/{args.repeats}] {mode} {framework}: {res['pairs_per_sec']:.2f} pairs/s "
                          f"({res['tokens'] / args.steps:.0f} tokens/step, median step {step:.2f} s)"
                          f"  peak RSS {res['peak_rss_mb']:.0f} MB  last loss {res['last_loss']:.4f}  threads "
                          f"{res['threads']}  load {res['load_avg_before']:.1f}->{res['load_avg_1min']:.1f}{pre}",
                          flush=True)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)

    def med(framework: str, mode: str, key: str):
        values = [r[key] for r in runs if r["framework"] == framework and r["mode"] == mode and r[key] is not None]
        return statistics.median(values) if values else None

    summary = []
    print("\n| mode | lightalign pairs/s | TRL pairs/s | ratio | lightalign peak RSS MB | TRL peak RSS MB "
          "| precompute s (lightalign / TRL) |\n|---|---|---|---|---|---|---|")
    for mode in args.modes:
        row = {"mode": mode, **{f"{fw}_{k}": med(fw, mode, k) for fw in FRAMEWORKS
                                for k in ("pairs_per_sec", "peak_rss_mb", "precompute_seconds")}}
        la, tr = row["lightalign_pairs_per_sec"], row["trl_pairs_per_sec"]
        row["ratio"] = la / tr if la and tr else None
        summary.append(row)
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        pre = ("-" if mode == "online" else
               f"{fmt(row['lightalign_precompute_seconds'], '.1f')} / {fmt(row['trl_precompute_seconds'], '.1f')}")
        print(f"| {mode} | {fmt(la, '.2f')} | {fmt(tr, '.2f')} | {fmt(row['ratio'], '.2f')}x "
              f"| {fmt(row['lightalign_peak_rss_mb'], '.0f')} | {fmt(row['trl_peak_rss_mb'], '.0f')} | {pre} |")
    out = ROOT / "bench" / "results" / "dpo.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": settings, "runs": runs, "summary": summary}, indent=2))
    print(f"\nwrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
