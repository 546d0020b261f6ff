"""DPO throughput and peak memory: lightalign's DPOModule vs TRL's DPOTrainer, same model, data and settings.

Run by hand from the repository root, in a separate venv so TRL never enters the dev venv:

    python3 -m venv /work/benchvenv && /work/benchvenv/bin/pip install torch==2.13.0
    /work/benchvenv/bin/pip install -e '.[bench]'
    /work/benchvenv/bin/python bench/dpo.py [--data examples/data/arithmetic_preference.jsonl] [--repeats 3]
    /work/benchvenv/bin/python bench/dpo.py --shape longtail --prompt-sharing on off   # generated data

The `small` config (~30M params) is built once under a fixed seed and saved to a temporary folder; both frameworks
load that folder (same weights). Two modes: `online` (a frozen reference model forwards every batch) and
`precomputed` (`precompute_ref_log_probs=True`: one reference pass before training, timed separately). Every
(framework, mode) runs in its own process (peak RSS = ru_maxrss of that process), frameworks alternating; pairs/s
counts the pairs of the --steps optimizer steps after --warmup steps, timed from step end to step end by a callback
(Lightning `on_train_batch_end`, transformers `on_step_end`). Each process gets fresh dataset and log-prob caches.
Results: a table on stdout and JSON in bench/results/dpo.json (medians over --repeats). MFU: the model FLOPs of
the timed window's pairs (bench/harness.py's formula; see `window_flops`) per second; bench/suite.py divides it by
the measured matmul peak.

Precision (bench/harness.py, the same for every script): `--precisions fp32 bf16` (default: both where the CPU has
native bf16, else fp32) runs each variant in each precision, lightalign with `precision="bf16-mixed"` / `"32-true"`,
TRL with `bf16=True` / `False`, everything else identical. Both dtypes' matmul peaks are measured once at the start
and printed; each run's efficiency is its model FLOP/s over the peak of its own dtype. The closing report lists every
variant (`framework:setting@precision`: figure, efficiency, peak RSS and PSS), each lightalign variant against TRL at
the same precision, and best vs best (each side's fastest variant over all precisions) with that pair's peak memory
ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data as bench_data  # noqa: E402
import harness  # noqa: E402

ROOT, FRAMEWORKS = harness.ROOT, harness.FRAMEWORKS
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
                            ref_log_probs_cache_dir=str(workdir / "ref_logps"), torch_compile=args.compile == "on",
                            retain_cpu_memory=args.retain_cpu_memory == "on",
                            recompute_mlp_activation=args.recompute_mlp_activation == "on")
    data = PreferenceDataModule(args.data, tokenizer=args.model_dir, max_length=args.max_length,
                                max_prompt_length=None, truncation_mode="keep_start", batch_size=args.batch_size,
                                num_workers=0, shuffle=False, prompt_sharing=args.prompt_sharing == "on")
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=harness.lightning_precision(args.precision), max_steps=meter.last,
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

    if args.trl_config == "best_malloc":  # TRL's best settings plus the allocator setting lightalign makes on CPU
        from lightalign.modules.training.acceleration import retain_freed_cpu_memory

        assert retain_freed_cpu_memory(), "mallopt refused the thresholds"

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
        max_steps=meter.last, learning_rate=args.lr, lr_scheduler_type="constant", optim="adamw_torch_fused",
        weight_decay=0.0, max_grad_norm=args.max_grad_norm, beta=args.beta, loss_type=["sigmoid"],
        max_length=args.max_length, truncation_mode="keep_start", precompute_ref_log_probs=precompute,
        bf16=harness.trl_bf16(args.precision), fp16=False, gradient_checkpointing=args.trl_config == "defaults", use_cpu=True,
        dataloader_num_workers=0,
        train_sampling_strategy="sequential", eval_strategy="no", save_strategy="no", report_to="none",
        disable_tqdm=True, logging_steps=10, seed=args.seed, torch_compile=args.compile == "on",
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
    pss = harness.PeakPSS()
    run = run_lightalign if args.framework == "lightalign" else run_trl
    extra = run(args, args.mode == "precomputed", meter, workdir)
    if meter.end is None:
        raise RuntimeError(f"training stopped before step {meter.last}: too few rows for the requested steps?")
    seconds = meter.end - meter.start
    return {"framework": args.framework, "mode": args.mode, "pairs_per_sec": meter.pairs / seconds,
            "tokens_per_sec": meter.tokens / seconds, "seconds": seconds, "pairs": meter.pairs,
            "tokens": meter.tokens, "last_loss": meter.loss, "threads": meter.threads,
            "peak_rss_mb": harness.peak_rss_mb(), "peak_pss_mb": pss.stop(), "precision": args.precision,
            "median_step_seconds": statistics.median(meter.step_seconds), "step_seconds": meter.step_seconds,
            "load_avg_1min": os.getloadavg()[0], **extra}


def window_flops(args: argparse.Namespace, online: bool) -> float:
    """Model FLOPs of the timed window (rows warmup*B .. (warmup+steps)*B in file order, as both sides read them):
    policy forward + backward of prompt+chosen and prompt+rejected (truncated to max_length), plus a reference
    forward when the reference runs online. The same figure for both frameworks: the work the method needs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    rows = [json.loads(line) for line in open(args.data) if line.strip()]
    rows = rows[args.warmup * args.batch_size:(args.warmup + args.steps) * args.batch_size]

    def length(prompt, completion) -> int:
        if isinstance(prompt, list):  # conversational
            n = len(tok.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"])
        else:
            n = len(tok(prompt + completion, add_special_tokens=False)["input_ids"])
        return min(n, args.max_length) if args.max_length else n

    lengths = [length(r["prompt"], r[k]) for r in rows for k in ("chosen", "rejected")]
    shape = harness.model_shape(args.model_dir)
    flops = harness.train_flops(args.n_params, shape["layers"], shape["hidden"], lengths)
    if online:
        flops += harness.forward_flops(args.n_params, shape["layers"], shape["hidden"], lengths)
    return flops


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "assets" / "models" / "small"), help="config + tokenizer folder")
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "chat_preference.jsonl"))
    parser.add_argument("--shape", choices=bench_data.SHAPES, help="generate preference data of this length shape "
                        "(bench/data.py) instead of --data")
    parser.add_argument("--mean-length", type=int, default=64, help="mean words per generated pair side")
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
    parser.add_argument("--prompt-sharing", nargs="+", default=["on"], choices=("on", "off"),
                        help="lightalign's shared-prompt pair layout (off: classic padded chosen/rejected rows); "
                             "`on off` runs lightalign both ways against the same TRL runs")
    parser.add_argument("--trl-config", nargs="+", default=["best"], choices=("best", "defaults", "best_malloc"),
                        help="TRL's side: `best` = its fastest CPU settings (gradient checkpointing off, like "
                             "lightalign); `defaults` = DPOConfig's own default gradient_checkpointing=True; "
                             "`best_malloc` = `best` with the glibc allocator thresholds lightalign sets on CPU "
                             "(retain_cpu_memory). Precision: --precisions, the same on both sides")
    parser.add_argument("--compile", choices=("off", "on"), default="off",
                        help="torch.compile the model on both sides (lightalign torch_compile=True, TRL "
                             "torch_compile=True; default options); raise --warmup to keep compilation out of the "
                             "timed steps")
    parser.add_argument("--retain-cpu-memory", choices=("on", "off"), default="on",
                        help="lightalign's retain_cpu_memory (glibc allocator thresholds; its default: on)")
    parser.add_argument("--recompute-mlp-activation", choices=("on", "off"), default="on",
                        help="lightalign's recompute_mlp_activation (MLP activation memory; its default: on)")
    parser.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    parser.add_argument("--max-contention", type=float,
                        help="wait before each run until other processes use less than this share of the machine")
    parser.add_argument("--max-load", type=float, help="wait before each run until the 1-min load average is below")
    parser.add_argument("--out", default="dpo.json", help="file name under bench/results/")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    harness.add_precision_arguments(parser)
    for hidden in ("--framework", "--mode", "--model-dir", "--workdir"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    return parser


def run(args: argparse.Namespace) -> dict:
    """Build the model (and data), run every (mode, framework[, prompt sharing]) --repeats times; return the result."""
    harness.peaks_of(args)
    args.workdir = tempfile.mkdtemp(prefix="bench-dpo-")
    try:
        args.model_dir = str(Path(args.workdir) / "model")
        args.n_params = n_params = harness.build_model(args.model, Path(args.model_dir), args.seed)
        if args.shape:
            n = max(64, 2 * (args.warmup + args.steps) * args.batch_size)
            args.data = str(bench_data.write(Path(args.workdir) / "pref.jsonl", "preference", args.shape, n,
                                             args.mean_length, args.seed))
        rows = sum(1 for line in open(args.data) if line.strip())
        if (args.warmup + args.steps) * args.batch_size > rows:
            raise SystemExit(f"{args.data} has {rows} rows: fewer than (warmup + steps) x batch-size; lower --steps.")
        settings = {
            "model": f"{Path(args.model).name}: {n_params / 1e6:.1f}M params, seed {args.seed}, saved once, both load",
            "data": f"generated preference, shape {args.shape}, mean {args.mean_length} words per side"
            if args.shape else Path(args.data).name, "batch_pairs": args.batch_size, "grad_accum": 1,
            "max_length": args.max_length, "max_prompt_length": None, "truncation_mode": "keep_start",
            "precisions": " / ".join(args.precisions) + " (fp32: lightalign 32-true, TRL bf16=False; bf16: lightalign bf16-mixed, TRL bf16=True)",
            "gradient_checkpointing": "lightalign off; TRL " + " / ".join(
                {"best": "off (best)", "defaults": "on (DPOConfig default)",
                 "best_malloc": "off (best, + lightalign's retain_cpu_memory allocator setting)"}[c]
                for c in args.trl_config),
            "optimizer": "torch AdamW fused (both defaults), wd 0",
            "lr": args.lr, "lr_schedule": "constant", "max_grad_norm": args.max_grad_norm, "beta": args.beta,
            "loss_type": "sigmoid", "lightalign_prompt_sharing": " / ".join(args.prompt_sharing),
            "torch_compile": args.compile, "lightalign_retain_cpu_memory": args.retain_cpu_memory,
            "lightalign_recompute_mlp_activation": args.recompute_mlp_activation,
            "threads": args.threads, "dataloader_workers": 0, "data_order": "sequential",
            "warmup_steps": args.warmup, "timed_steps": args.steps, "repeats": args.repeats,
            "versions": harness.versions(),
        }
        harness.print_settings("DPO benchmark: lightalign DPOModule vs TRL DPOTrainer", settings)
        print("  (TRL 1.x has no max_prompt_length, so lightalign gets None too. No eval, checkpoints or loggers.)\n",
              flush=True)
        flops = {mode: window_flops(args, mode == "online") for mode in args.modes}
        runs = []
        for r in range(args.repeats):
            for mode in args.modes:
                jobs = [(fw, variant, precision) for precision in args.precisions
                        for fw in harness.alternate(args.frameworks, r)
                        for variant in (args.prompt_sharing if fw == "lightalign" else args.trl_config)]
                for framework, variant, precision in jobs:
                    sharing, trl_config = (variant, None) if framework == "lightalign" else (None, variant)
                    harness.wait_for_load(args.max_load)
                    harness.wait_for_quiet(args.max_contention)
                    load_before = os.getloadavg()[0]
                    argv = ["--framework", framework, "--mode", mode, "--model-dir", args.model_dir, "--workdir",
                            args.workdir, "--data", args.data, "--batch-size", args.batch_size, "--max-length",
                            args.max_length, "--steps", args.steps, "--warmup", args.warmup, "--threads",
                            args.threads, "--lr", args.lr, "--beta", args.beta, "--max-grad-norm",
                            args.max_grad_norm, "--seed", args.seed, "--prompt-sharing", sharing or "on",
                            "--trl-config", trl_config or "best", "--compile", args.compile,
                            "--retain-cpu-memory", args.retain_cpu_memory,
                            "--recompute-mlp-activation", args.recompute_mlp_activation, "--precision", precision]
                    name = (f"{framework}:{mode}+" + (f"prompt_sharing_{sharing}" if sharing else trl_config)
                            + f"@{precision}")
                    res = harness.spawn(__file__, argv, args.threads, f"dpo {name}")
                    if res is None:
                        continue
                    res.update(load_avg_before=load_before, prompt_sharing=sharing, trl_config=trl_config,
                               repeat=r + 1, variant=name, setting=mode,
                               model_flops_per_sec=flops[mode] / res["seconds"])
                    runs.append(res)
                    pre = f"  precompute {res['precompute_seconds']:.1f} s" if res["precompute_seconds"] else ""
                    tag = f"{framework}" + (f" (prompt_sharing {sharing})" if sharing else f" ({trl_config})") + (
                        f" {precision}")
                    print(f"[{r + 1}/{args.repeats}] {mode} {tag}: {res['pairs_per_sec']:.2f} pairs/s "
                          f"(median step {res['median_step_seconds']:.2f} s)  peak RSS {res['peak_rss_mb']:.0f} MB"
                          f"  last loss {res['last_loss']:.4f}  threads {res['threads']}  "
                          f"load {res['load_avg_before']:.1f}->{res['load_avg_1min']:.1f}{pre}", flush=True)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)

    summary = []
    for mode in args.modes:
        for sharing in args.prompt_sharing:
            for trl_config in args.trl_config:
                for precision in args.precisions:
                    row = {"mode": mode, "prompt_sharing": sharing, "trl_config": trl_config, "precision": precision}
                    for fw, match in (("lightalign", {"prompt_sharing": sharing}),
                                      ("trl", {"trl_config": trl_config})):
                        for k in ("pairs_per_sec", "model_flops_per_sec", "peak_rss_mb", "peak_pss_mb",
                                  "precompute_seconds"):
                            row[f"{fw}_{k}"] = harness.median_of(runs, k, framework=fw, mode=mode,
                                                                 precision=precision, **match)
                    row["ratio"] = harness.ratio(row["lightalign_pairs_per_sec"], row["trl_pairs_per_sec"])
                    summary.append(row)
    return {"settings": settings, "runs": runs, "summary": summary, "n_params": n_params,
            "precision_report": harness.precision_report(runs, "pairs_per_sec", args.peaks)}


def main() -> None:
    args = build_parser().parse_args()
    args.data = str(Path(args.data).resolve())
    if args.one:
        args.prompt_sharing, args.trl_config = args.prompt_sharing[0], args.trl_config[0]
        harness.emit(run_one(args))
        return
    result = run(args)
    print("\n| mode | prompt sharing | TRL config | precision | lightalign pairs/s | TRL pairs/s | ratio | lightalign peak RSS MB "
          "| TRL peak RSS MB | precompute s (lightalign / TRL) |\n|---|---|---|---|---|---|---|---|---|---|")
    fmt = harness.fmt
    for row in result["summary"]:
        pre = ("-" if row["mode"] == "online" else
               f"{fmt(row['lightalign_precompute_seconds'], '.1f')} / {fmt(row['trl_precompute_seconds'], '.1f')}")
        print(f"| {row['mode']} | {row['prompt_sharing']} | {row['trl_config']} | {row['precision']} "
              f"| {fmt(row['lightalign_pairs_per_sec'], '.2f')} "
              f"| {fmt(row['trl_pairs_per_sec'], '.2f')} | {fmt(row['ratio'], '.2f')}x "
              f"| {fmt(row['lightalign_peak_rss_mb'], '.0f')} | {fmt(row['trl_peak_rss_mb'], '.0f')} | {pre} |")
    harness.print_precision_report(result["precision_report"])
    print(f"\nwrote {harness.write_json(args.out, result).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
