"""SFT throughput, MFU and peak memory: lightalign's SFTModule vs TRL's SFTTrainer, same model, data and settings.

Run from the repository root in the benchmark venv (TRL is a benchmark-only extra: `pip install -e '.[bench]'`):

    python bench/sft.py [--model assets/models/small] [--shape longtail] [--steps 20] [--repeats 3]
    python bench/sft.py --data examples/data/chat_sft.jsonl --frameworks lightalign   # no TRL needed

Variants (both sides): `padding` (padded rows), `padding_free` (rows concatenated, position_ids restart per
document), `packing` (documents packed into max_length bins; TRL: bfd), `group_by_length` (padded rows, batches of
similar lengths; TRL: train_sampling_strategy="group_by_length"; lightalign: used only if SFTDataModule accepts
`group_by_length`, else the row says n/a). Data: a generated prompt-completion set of the chosen --shape
(bench/data.py) unless --data is given; loss on the completion on both sides. Tokens/s counts the non-padding
tokens of the optimizer steps --warmup+1 .. --warmup+--steps; MFU uses bench/harness.py's formula on the real
sequence lengths of those steps. GEMM share: the time the linear layers' matrix products alone take for the same
micro-batches (bench/harness.py's gemm_floor_seconds, timed once in the parent process after all runs, so every
run is measured against the same timings) over the run's wall time: how close a run comes to the machine's own
limit on that work. Each (framework, variant) runs in its own process, frameworks alternating; figures are
medians over --repeats. Results: a table and bench/results/sft.json (--out to change).

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
import inspect
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data as bench_data  # noqa: E402
import harness  # noqa: E402

VARIANTS = ("padding", "padding_free", "packing", "group_by_length")
LIGHTALIGN = {"padding": {}, "padding_free": {"padding_free": True}, "packing": {"packing": True},
              "group_by_length": {"group_by_length": True}}
TRL = {"padding": {}, "padding_free": {"padding_free": True}, "packing": {"packing": True, "packing_strategy": "bfd"},
       "group_by_length": {"train_sampling_strategy": "group_by_length"}}


class Meter:
    """Sums the real sequence lengths of the micro-batches of optimizer steps warmup+1 .. warmup+steps."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.last = warmup, warmup + steps
        self.window = harness.Window()
        self.pending: list[list[int]] = []
        self.lengths: list[int] = []
        self.batch_tokens: list[int] = []  # real tokens of each timed micro-batch (bench/harness.py's GEMM floor)
        self.seen = 0

    def batch(self, batch) -> None:
        self.pending.append(harness.sequence_lengths(batch))

    def step_end(self, step: int) -> None:
        if step == self.seen:
            return  # still accumulating
        self.seen = step
        if step == self.warmup:
            self.window.start()
        elif self.window.running:
            self.lengths += [n for lengths in self.pending for n in lengths]
            self.batch_tokens += [sum(lengths) for lengths in self.pending]
            if step == self.last:
                self.window.stop()
        self.pending = []


def run_lightalign(args: argparse.Namespace, meter: Meter) -> dict:
    import lightning as L

    from lightalign import SFTDataModule, SFTModule

    extra = LIGHTALIGN[args.variant]
    if extra and not all(k in inspect.signature(SFTDataModule.__init__).parameters for k in extra):
        return {"unavailable": f"SFTDataModule has no {', '.join(extra)}"}

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            meter.batch(batch)
            meter.step_end(trainer.global_step)

    L.seed_everything(args.seed, verbose=False)
    module = SFTModule(args.model_dir, learning_rate=args.lr, lr_scheduler_type="constant",
                       gradient_checkpointing=args.gradient_checkpointing == "on",
                       retain_cpu_memory=args.retain_cpu_memory == "on",
                       recompute_mlp_activation=args.recompute_mlp_activation == "on")
    data = SFTDataModule(args.data, tokenizer=args.model_dir, max_length=args.max_length, batch_size=args.batch_size,
                         num_workers=0, shuffle=args.variant == "group_by_length", seed=args.seed, **extra)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=harness.lightning_precision(args.precision), max_steps=meter.last,
                        accumulate_grad_batches=args.grad_accum, gradient_clip_val=args.max_grad_norm, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Clock()])
    trainer.fit(module, data)
    return {"attn": module.model.config._attn_implementation}


def run_trl(args: argparse.Namespace, meter: Meter, workdir: Path) -> dict:
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            meter.step_end(state.global_step)

    class MeteredSFTTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, *a, **kw):
            if model.training:
                meter.batch(inputs)
            return super().compute_loss(model, inputs, *a, **kw)

    variant = {"train_sampling_strategy": "sequential", **TRL[args.variant]}
    if args.variant == "padding_free":  # TRL refuses max_length with padding_free and no packing (not enforced)
        variant["max_length"] = None
    config = SFTConfig(
        output_dir=str(workdir / "trl_out"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, max_steps=meter.last, learning_rate=args.lr,
        lr_scheduler_type="constant", optim="adamw_torch_fused", weight_decay=0.0, max_grad_norm=args.max_grad_norm,
        **{"max_length": args.max_length, **variant}, truncation_mode="keep_start", completion_only_loss=True,
        bf16=harness.trl_bf16(args.precision), fp16=False,
        gradient_checkpointing=args.gradient_checkpointing == "on", use_cpu=True, dataloader_num_workers=0,
        eval_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=10,
        seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    dataset = load_dataset("json", data_files=args.data, split="train")
    trainer = MeteredSFTTrainer(model=args.model_dir, args=config, train_dataset=dataset, processing_class=tokenizer,
                                callbacks=[Clock()])
    trainer.train()
    return {"attn": trainer.model.config._attn_implementation}


def run_one(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix=f"sft-{args.framework}-{args.variant}-", dir=args.workdir))
    os.environ["HF_DATASETS_CACHE"] = str(workdir / "datasets")  # no dataset cache hit across runs
    meter = Meter(args.warmup, args.steps)
    pss = harness.PeakPSS()
    extra = run_lightalign(args, meter) if args.framework == "lightalign" else run_trl(args, meter, workdir)
    base = {"framework": args.framework, "setting": args.variant, "precision": args.precision,
            "variant": f"{args.framework}:{args.variant}@{args.precision}", "threads": torch.get_num_threads(),
            "peak_rss_mb": harness.peak_rss_mb(), "peak_pss_mb": pss.stop()}
    if "unavailable" in extra:
        return {**base, **extra}
    if meter.window.seconds is None:
        raise RuntimeError(f"training stopped before step {meter.last}: too few rows for the requested steps?")
    seconds = meter.window.seconds
    shape = harness.model_shape(args.model_dir)
    flops = harness.train_flops(args.n_params, shape["layers"], shape["hidden"], meter.lengths)
    return {**base, "tokens_per_sec": sum(meter.lengths) / seconds, "sequences_per_sec": len(meter.lengths) / seconds,
            "model_flops_per_sec": flops / seconds, "seconds": seconds, "tokens": sum(meter.lengths),
            "batch_tokens": meter.batch_tokens,
            "others_cpu_share": meter.window.others_cpu_share, **extra}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(harness.ROOT / "assets" / "models" / "small"), help="config + tokenizer")
    p.add_argument("--data", help="JSONL (any TRL SFT format); default: generated, see --shape")
    p.add_argument("--shape", default="longtail", choices=bench_data.SHAPES)
    p.add_argument("--mean-length", type=int, default=96, help="mean words per generated example")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--gradient-checkpointing", default="off", choices=("on", "off"))
    p.add_argument("--retain-cpu-memory", default="on", choices=("on", "off"),
                   help="lightalign's retain_cpu_memory (glibc allocator thresholds; its default: on)")
    p.add_argument("--recompute-mlp-activation", default="on", choices=("on", "off"),
                   help="lightalign's recompute_mlp_activation (MLP activation memory; its default: on)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", "--settings", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--frameworks", nargs="+", default=list(harness.FRAMEWORKS), choices=harness.FRAMEWORKS)
    p.add_argument("--max-contention", type=float, help="wait before each run until others use less of the machine")
    p.add_argument("--out", default="sft.json", help="file name under bench/results/")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    harness.add_precision_arguments(p)
    for hidden in ("--framework", "--variant", "--model-dir", "--workdir", "--n-params"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    return p


CHILD_FLAGS = ("data", "max_length", "batch_size", "grad_accum", "gradient_checkpointing", "retain_cpu_memory",
               "recompute_mlp_activation", "steps", "warmup", "threads", "lr", "max_grad_norm", "seed", "model_dir",
               "workdir", "n_params")


def run(args: argparse.Namespace) -> dict:
    """Build the model and data, run every (variant, framework) --repeats times; return settings, runs, summary."""
    import shutil

    harness.peaks_of(args)
    args.workdir = tempfile.mkdtemp(prefix="bench-sft-")
    try:
        args.model_dir = str(Path(args.workdir) / "model")
        args.n_params = harness.build_model(args.model, Path(args.model_dir), args.seed)
        rows = (args.warmup + args.steps) * args.batch_size * args.grad_accum
        if args.data is None:
            args.data = str(bench_data.write(Path(args.workdir) / "sft.jsonl", "sft", args.shape, max(4 * rows, 64),
                                             args.mean_length, args.seed))
        settings = {
            "model": f"{Path(args.model).name}: {args.n_params / 1e6:.1f}M params, seed {args.seed}, saved once, "
                     "both load", "data": args.data if "bench-sft-" not in args.data
            else f"generated prompt-completion, shape {args.shape}, mean {args.mean_length} words",
            "max_length": args.max_length, "truncation_mode": "keep_start", "loss": "completion only",
            "batch": args.batch_size, "grad_accum": args.grad_accum,
            "gradient_checkpointing": args.gradient_checkpointing,
            "precisions": " / ".join(args.precisions) + " (fp32: lightalign 32-true, TRL bf16=False; bf16: lightalign bf16-mixed, TRL bf16=True)",
            "lightalign_retain_cpu_memory": args.retain_cpu_memory,
            "lightalign_recompute_mlp_activation": args.recompute_mlp_activation,
            "optimizer": "torch AdamW fused (both defaults), wd 0", "lr": f"{args.lr} constant",
            "max_grad_norm": args.max_grad_norm, "trl_padding_free": "max_length=None (TRL does not truncate "
            "padding-free batches without packing and refuses max_length; tokens/s counts what was trained)",
            "threads": args.threads, "dataloader_workers": 0,
            "data_order": "sequential (group_by_length: length-grouped)", "warmup_steps": args.warmup,
            "timed_steps": args.steps, "repeats": args.repeats, "versions": harness.versions(),
        }
        harness.print_settings("SFT benchmark: lightalign SFTModule vs TRL SFTTrainer", settings)
        argv = [x for name in CHILD_FLAGS for x in ("--" + name.replace("_", "-"), getattr(args, name))]
        runs = []
        for r in range(args.repeats):
            for variant, precision in [(v, p) for v in args.variants for p in args.precisions]:
                for fw in harness.alternate(args.frameworks, r):
                    harness.wait_for_quiet(args.max_contention)
                    res = harness.spawn(__file__, argv + ["--framework", fw, "--variant", variant, "--precision",
                                                          precision], args.threads, f"sft {variant}@{precision} {fw}")
                    if res is None:
                        continue
                    runs.append({**res, "repeat": r + 1})
                    print(f"[{r + 1}/{args.repeats}] {variant}@{precision} {fw}: " + (
                        res["unavailable"] if "unavailable" in res else
                        f"{res['tokens_per_sec']:.0f} tokens/s  peak RSS {res['peak_rss_mb']:.0f} MB  "
                        f"others {100 * (res['others_cpu_share'] or 0):.0f}% of the machine"), flush=True)
        measured = [r for r in runs if "unavailable" not in r]
        if measured:  # one floor for every run, timed here after them all (module docstring)
            import torch

            torch.set_num_threads(args.threads)
            cache: dict[int, float] = {}
            for r in measured:
                r["gemm_floor_seconds"] = harness.gemm_floor_seconds(args.model_dir, r["batch_tokens"], cache=cache)
                r["gemm_share"] = r["gemm_floor_seconds"] / r["seconds"]
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    summary = []
    for variant, precision in [(v, p) for v in args.variants for p in args.precisions]:
        row = {"variant": variant, "precision": precision}
        for fw in args.frameworks:
            for key in ("tokens_per_sec", "model_flops_per_sec", "gemm_share", "peak_rss_mb", "peak_pss_mb"):
                row[f"{fw}_{key}"] = harness.median_of(measured, key, framework=fw, setting=variant,
                                                       precision=precision)
            missing = [r["unavailable"] for r in runs if r["framework"] == fw and r["setting"] == variant
                       and r["precision"] == precision and "unavailable" in r]
            if missing:
                row[f"{fw}_unavailable"] = missing[0]
        row["ratio"] = harness.ratio(row.get("lightalign_tokens_per_sec"), row.get("trl_tokens_per_sec"))
        summary.append(row)
    return {"settings": settings, "runs": runs, "summary": summary, "n_params": args.n_params,
            "precision_report": harness.precision_report(measured, "tokens_per_sec", args.peaks)}


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.one:
        args.n_params = int(args.n_params)
        harness.emit(run_one(args))
        return
    if args.data:
        args.data = str(Path(args.data).resolve())
    result = run(args)
    print("\n| variant | precision | lightalign tokens/s | TRL tokens/s | ratio | GEMM share (lightalign / TRL) "
          "| lightalign peak RSS MB | TRL peak RSS MB |\n|---|---|---|---|---|---|---|---|")
    for row in result["summary"]:
        print(f"| {row['variant']} | {row['precision']} | {harness.fmt(row.get('lightalign_tokens_per_sec'), '.0f')} "
              f"| {harness.fmt(row.get('trl_tokens_per_sec'), '.0f')} | {harness.fmt(row['ratio'], '.2f')} "
              f"| {harness.fmt(row.get('lightalign_gemm_share'), '.1%')} "
              f"/ {harness.fmt(row.get('trl_gemm_share'), '.1%')} "
              f"| {harness.fmt(row.get('lightalign_peak_rss_mb'), '.0f')} "
              f"| {harness.fmt(row.get('trl_peak_rss_mb'), '.0f')} |")
    harness.print_precision_report(result["precision_report"])
    print(f"\nwrote {harness.write_json(args.out, result).relative_to(harness.ROOT)}")


if __name__ == "__main__":
    main()
