"""KTO throughput and peak memory: lightalign's KTOModule vs TRL's KTOTrainer, same model, data and settings.

Run by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    make .venv-bench/.installed
    .venv-bench/bin/python bench/kto_speed.py [--shape longtail] [--repeats 3] [--modes online precomputed]
    .venv-bench/bin/python bench/kto_speed.py --data examples/data/arithmetic_unpaired.jsonl   # a file instead

bench/dpo.py's benchmark with the KTO trainers on both sides (its Meter is reused; "pairs" there are rows here).
The `small` config (~30M params) is built once under a fixed seed and saved to a temporary folder that both
frameworks load. Data: unpaired rows generated at run time (bench/data.py, kind `unpaired`, labels alternating so
every batch holds both kinds), or --data. Both sides: the `kto` loss (the KL estimate: every row also runs its
prompt with another row's completion, without gradients, on the policy and on the reference), TRL's sequential
order (lightalign `shuffle: false`; KTOConfig's default `train_sampling_strategy="sequential"`), batch of
--batch-size rows, no accumulation, max_length on both sides, --precisions, torch AdamW fused, constant lr, clip 1.0.
TRL's side at its best CPU settings (gradient checkpointing off, as lightalign; `--trl-config defaults` keeps
KTOConfig's default `gradient_checkpointing=True`). Two modes: `online` (the frozen reference forwards every batch)
and `precomputed` (`precompute_ref_log_probs=True`: one reference pass before training at the training batch size,
timed separately). Every (framework, mode) runs in its own process (peak RSS = its ru_maxrss), frameworks
alternating; rows/s counts the rows of the --steps optimizer steps after --warmup steps, timed from step end to step
end by a callback. Contention: each run waits for a quiet machine first (--max-contention) and reports the share of
the machine other processes took during its timed window; a negative --max-contention does not wait (the figures
are then contended and labelled so). Results: stdout and bench/results/kto.json (medians over --repeats).

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
import dpo as bench_dpo  # noqa: E402
import harness  # noqa: E402

ROOT, FRAMEWORKS = harness.ROOT, harness.FRAMEWORKS
MODES = ("online", "precomputed")
Meter = bench_dpo.Meter


def run_lightalign(args: argparse.Namespace, precompute: bool, meter: Meter, workdir: Path) -> dict:
    import lightning as L

    from lightalign import KTOModule, UnpairedPreferenceDataModule

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            meter.batch(pl_module.last_batch_samples, pl_module.last_batch_tokens, outputs["loss"])
            meter.step_end(trainer.global_step)

    class TimedKTOModule(KTOModule):
        precompute_seconds = 0.0

        def precompute_reference(self, datamodule):
            start = time.perf_counter()
            super().precompute_reference(datamodule)
            self.precompute_seconds += time.perf_counter() - start

    L.seed_everything(args.seed, verbose=False)
    module = TimedKTOModule(args.model_dir, beta=args.beta, loss_type="kto", learning_rate=args.lr,
                            lr_scheduler_type="constant", precompute_ref_log_probs=precompute,
                            ref_log_probs_cache_dir=str(workdir / "ref_logps"),
                            recompute_mlp_activation=args.recompute_mlp_activation == "on")
    data = UnpairedPreferenceDataModule(args.data, tokenizer=args.model_dir, max_length=args.max_length,
                                        batch_size=args.batch_size, val_batch_size=args.batch_size, num_workers=0,
                                        shuffle=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=harness.lightning_precision(args.precision), max_steps=meter.last,
                        accumulate_grad_batches=1, gradient_clip_val=args.max_grad_norm, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Clock()])
    trainer.fit(module, data)
    return {"precompute_seconds": module.precompute_seconds if precompute else None}


def run_trl(args: argparse.Namespace, precompute: bool, meter: Meter, workdir: Path) -> dict:
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import KTOConfig, KTOTrainer

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            meter.step_end(state.global_step)

    class TimedKTOTrainer(KTOTrainer):
        precompute_seconds = 0.0

        def _precompute_ref_logps(self, *a, **kw):  # called from __init__
            start = time.perf_counter()
            out = super()._precompute_ref_logps(*a, **kw)
            TimedKTOTrainer.precompute_seconds += time.perf_counter() - start
            return out

        def compute_loss(self, model, inputs, *a, **kw):
            loss = super().compute_loss(model, inputs, *a, **kw)
            if model.training:
                tokens = int(inputs["attention_mask"].sum()) + int(inputs["KL_attention_mask"].sum())
                meter.batch(inputs["input_ids"].shape[0], tokens, loss.detach())
            return loss

    config = KTOConfig(
        output_dir=str(workdir / "trl_out"), per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
        max_steps=meter.last, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch_fused", weight_decay=0.0, max_grad_norm=args.max_grad_norm, beta=args.beta,
        loss_type="kto", max_length=args.max_length, precompute_ref_log_probs=precompute, bf16=harness.trl_bf16(args.precision), fp16=False,
        gradient_checkpointing=args.trl_config == "defaults", use_cpu=True, dataloader_num_workers=0,
        train_sampling_strategy="sequential", eval_strategy="no", save_strategy="no", report_to="none",
        disable_tqdm=True, logging_steps=10, seed=args.seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    dataset = load_dataset("json", data_files=args.data, split="train")
    trainer = TimedKTOTrainer(model=args.model_dir, args=config, train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[Clock()])
    trainer.train()
    return {"precompute_seconds": TimedKTOTrainer.precompute_seconds if precompute else None}


def run_one(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix=f"kto-{args.framework}-{args.mode}-", dir=args.workdir))
    os.environ["HF_DATASETS_CACHE"] = str(workdir / "datasets")  # no dataset/ref-logps cache hit across runs
    meter = Meter(args.warmup, args.steps)
    window = harness.Window()
    window.start()
    pss = harness.PeakPSS()
    run = run_lightalign if args.framework == "lightalign" else run_trl
    extra = run(args, args.mode == "precomputed", meter, workdir)
    window.stop()
    if meter.end is None:
        raise RuntimeError(f"training stopped before step {meter.last}: too few rows for the requested steps?")
    seconds = meter.end - meter.start
    return {"framework": args.framework, "mode": args.mode, "rows_per_sec": meter.pairs / seconds,
            "tokens_per_sec": meter.tokens / seconds, "seconds": seconds, "rows": meter.pairs,
            "tokens": meter.tokens, "last_loss": meter.loss, "threads": meter.threads,
            "peak_rss_mb": harness.peak_rss_mb(), "peak_pss_mb": pss.stop(), "precision": args.precision,
            "others_cpu_share": window.others_cpu_share,
            "median_step_seconds": statistics.median(meter.step_seconds), **extra}


def window_flops(args: argparse.Namespace, online: bool) -> float:
    """Model FLOPs of the timed window (rows warmup*B .. (warmup+steps)*B in file order, as both sides read them):
    the policy's forward + backward over each row, its forward (no gradient) over each row's mismatched sequence
    (the row's prompt with the completion of the row before it in its batch; the first takes the last's), and, when
    the reference runs online, the reference's forward over both. The same figure for both frameworks."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    rows = [json.loads(line) for line in open(args.data) if line.strip()]
    rows = rows[args.warmup * args.batch_size:(args.warmup + args.steps) * args.batch_size]

    def length(text: str) -> int:
        n = len(tok(text)["input_ids"]) + 1  # + EOS
        return min(n, args.max_length) if args.max_length else n

    lengths, kl_lengths = [], []
    for start in range(0, len(rows), args.batch_size):
        block = rows[start:start + args.batch_size]
        for i, row in enumerate(block):
            lengths.append(length(row["prompt"] + row["completion"]))
            kl_lengths.append(length(row["prompt"] + block[i - 1]["completion"]))
    shape = harness.model_shape(args.model_dir)
    fwd = lambda ls: harness.forward_flops(args.n_params, shape["layers"], shape["hidden"], ls)  # noqa: E731
    flops = harness.train_flops(args.n_params, shape["layers"], shape["hidden"], lengths) + fwd(kl_lengths)
    return flops + (fwd(lengths) + fwd(kl_lengths) if online else 0.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "assets" / "models" / "small"), help="config + tokenizer folder")
    parser.add_argument("--data", help="unpaired rows (prompt, completion, label) instead of generated ones")
    parser.add_argument("--shape", choices=bench_data.SHAPES, default="longtail",
                        help="length shape of the generated rows (bench/data.py); ignored with --data")
    parser.add_argument("--mean-length", type=int, default=64, help="mean words per generated row")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step (per device, no accumulation)")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--trl-config", choices=("best", "defaults"), default="best",
                        help="TRL's side: `best` = gradient checkpointing off (as lightalign); `defaults` = "
                             "KTOConfig's gradient_checkpointing=True. Precision: --precisions, the same on both sides")
    parser.add_argument("--recompute-mlp-activation", choices=("on", "off"), default="on",
                        help="lightalign's recompute_mlp_activation (MLP activation memory for some compute; its "
                             "default: on)")
    parser.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    parser.add_argument("--max-contention", type=float, default=0.05,
                        help="wait before each run until other processes use less than this share of the machine; "
                             "negative: do not wait (figures marked contended)")
    parser.add_argument("--out", default="kto.json", help="file name under bench/results/")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    harness.add_precision_arguments(parser)
    for hidden in ("--framework", "--mode", "--model-dir", "--workdir"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    return parser


def run(args: argparse.Namespace) -> dict:
    """Build the model (and data), run every (mode, framework) --repeats times; return the result."""
    contention = None if args.max_contention is None or args.max_contention < 0 else args.max_contention
    harness.peaks_of(args)
    args.workdir = tempfile.mkdtemp(prefix="bench-kto-")
    try:
        args.model_dir = str(Path(args.workdir) / "model")
        args.n_params = n_params = harness.build_model(args.model, Path(args.model_dir), args.seed)
        generated = not args.data
        if generated:
            n = max(64, 2 * (args.warmup + args.steps) * args.batch_size)
            args.data = str(bench_data.write(Path(args.workdir) / "unpaired.jsonl", "unpaired", args.shape, n,
                                             args.mean_length, args.seed))
        rows = sum(1 for line in open(args.data) if line.strip())
        if (args.warmup + args.steps) * args.batch_size > rows:
            raise SystemExit(f"{args.data} has {rows} rows: fewer than (warmup + steps) x batch-size; lower --steps.")
        settings = {
            "model": f"{Path(args.model).name}: {n_params / 1e6:.1f}M params, seed {args.seed}, saved once, both load",
            "data": f"generated unpaired rows, shape {args.shape}, mean {args.mean_length} words" if generated
            else Path(args.data).name, "batch_rows": args.batch_size, "grad_accum": 1,
            "max_length": args.max_length, "loss_type": "kto", "beta": args.beta,
            "precisions": " / ".join(args.precisions) + " (fp32: lightalign 32-true, TRL bf16=False; bf16: lightalign bf16-mixed, TRL bf16=True)",
            "order": "sequential (lightalign shuffle false, TRL train_sampling_strategy sequential)",
            "gradient_checkpointing": "lightalign off; TRL " + ("off (best)" if args.trl_config == "best"
                                                                 else "on (KTOConfig default)"),
            "optimizer": "torch AdamW fused (both defaults), wd 0", "lr": args.lr, "lr_schedule": "constant",
            "max_grad_norm": args.max_grad_norm, "threads": args.threads, "dataloader_workers": 0,
            "lightalign_recompute_mlp_activation": args.recompute_mlp_activation,
            "warmup_steps": args.warmup, "timed_steps": args.steps, "repeats": args.repeats,
            "max_contention": contention, "versions": harness.versions(),
        }
        harness.print_settings("KTO benchmark: lightalign KTOModule vs TRL KTOTrainer", settings)
        flops = {mode: window_flops(args, mode == "online") for mode in args.modes}
        runs = []
        for r in range(args.repeats):
            for mode, precision in [(m, p) for m in args.modes for p in args.precisions]:
                for framework in harness.alternate(args.frameworks, r):
                    harness.wait_for_quiet(contention)
                    argv = ["--framework", framework, "--mode", mode, "--model-dir", args.model_dir, "--workdir",
                            args.workdir, "--data", args.data, "--batch-size", args.batch_size, "--max-length",
                            args.max_length, "--steps", args.steps, "--warmup", args.warmup, "--threads",
                            args.threads, "--lr", args.lr, "--beta", args.beta, "--max-grad-norm",
                            args.max_grad_norm, "--seed", args.seed, "--trl-config", args.trl_config,
                            "--recompute-mlp-activation", args.recompute_mlp_activation, "--precision", precision]
                    name = f"{framework}:{mode}@{precision}"
                    res = harness.spawn(__file__, argv, args.threads, f"kto {name}")
                    if res is None:
                        continue
                    res.update(repeat=r + 1, variant=name, setting=mode, model_flops_per_sec=flops[mode] / res["seconds"],
                               contended=contention is None or res["others_cpu_share"] > contention)
                    runs.append(res)
                    pre = f"  precompute {res['precompute_seconds']:.1f} s" if res["precompute_seconds"] else ""
                    print(f"[{r + 1}/{args.repeats}] {name}: {res['rows_per_sec']:.2f} rows/s "
                          f"(median step {res['median_step_seconds']:.2f} s)  peak RSS {res['peak_rss_mb']:.0f} MB"
                          f"  last loss {res['last_loss']:.4f}  threads {res['threads']}  other processes "
                          f"{100 * res['others_cpu_share']:.0f}% of the machine{pre}", flush=True)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)

    summary = []
    for mode, precision in [(m, p) for m in args.modes for p in args.precisions]:
        row = {"mode": mode, "precision": precision}
        for fw in FRAMEWORKS:
            for k in ("rows_per_sec", "model_flops_per_sec", "peak_rss_mb", "peak_pss_mb", "precompute_seconds",
                      "others_cpu_share"):
                row[f"{fw}_{k}"] = harness.median_of(runs, k, framework=fw, mode=mode, precision=precision)
        row["ratio"] = harness.ratio(row["lightalign_rows_per_sec"], row["trl_rows_per_sec"])
        summary.append(row)
    return {"settings": settings, "runs": runs, "summary": summary, "n_params": n_params,
            "precision_report": harness.precision_report(runs, "rows_per_sec", args.peaks)}


def main() -> None:
    args = build_parser().parse_args()
    if args.data:
        args.data = str(Path(args.data).resolve())
    if args.one:
        harness.emit(run_one(args))
        return
    result = run(args)
    fmt = harness.fmt
    print("\n| mode | precision | lightalign rows/s | TRL rows/s | ratio | lightalign peak RSS MB | TRL peak RSS MB "
          "| precompute s (lightalign / TRL) |\n|---|---|---|---|---|---|---|---|")
    for row in result["summary"]:
        pre = ("-" if row["mode"] == "online" else
               f"{fmt(row['lightalign_precompute_seconds'], '.1f')} / {fmt(row['trl_precompute_seconds'], '.1f')}")
        print(f"| {row['mode']} | {row['precision']} | {fmt(row['lightalign_rows_per_sec'], '.2f')} | {fmt(row['trl_rows_per_sec'], '.2f')} "
              f"| {fmt(row['ratio'], '.2f')}x | {fmt(row['lightalign_peak_rss_mb'], '.0f')} "
              f"| {fmt(row['trl_peak_rss_mb'], '.0f')} | {pre} |")
    contended = sum(r["contended"] for r in result["runs"])
    if contended:
        print(f"WARNING: {contended} run(s) shared the machine with other processes (see above); figures are skewed.")
    harness.print_precision_report(result["precision_report"])
    print(f"\nwrote {harness.write_json(args.out, result).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
