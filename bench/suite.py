"""The benchmark suite: SFT, DPO, GRPO, KTO, RLOO, online DPO and distillation, lightalign vs TRL, over models x data
shapes x precisions, in one command.

    python bench/suite.py                                   # the real run (quiet machine, ~hours on 2 cores)
    python bench/suite.py --quick --models tiny             # smoke run: tiny settings, proves the plumbing
    python bench/suite.py --models small --shapes longtail  # the rows the targets are read from
    python bench/suite.py --precisions fp32                 # fp32 only (default: fp32 and bf16 on native-bf16 CPUs)
    taskset -c 1 python bench/suite.py --sweep --threads 1  # the precision sweep (bench/sweep_precision.sh)
    python bench/suite.py --plot-only bench/results/suite.json   # redraw the chart (needs only matplotlib)

Needs the benchmark extra (`pip install -e '.[bench]'`: TRL + matplotlib; `make bench` builds a separate venv).
First the machine's matmul peaks are measured, one per precision's dtype (harness.measure_peaks: fp32 and bf16
`torch.mm`), once for the whole suite and printed; then for each model and data shape (bench/data.py) it runs
bench/sft.py (padding / padding_free / packing / group_by_length), bench/dpo.py (online / precomputed reference,
lightalign prompt_sharing on / off, TRL at its best CPU settings and at its DPOConfig defaults), bench/grpo.py
(prompt_sharing off alternating with TRL, then on, marked `+prompt_sharing`), bench/kto_speed.py (online /
precomputed reference), bench/rloo.py, bench/online_dpo.py and bench/distill.py (both on `--data english` of the
shape), each variant in each of --precisions (fp32: lightalign 32-true, TRL bf16=False; bf16: lightalign bf16-mixed, TRL bf16=True), each run in
its own process, frameworks alternating, medians over --repeats.
Per method the script's report is printed (every variant with its figure, efficiency = model FLOP/s over the matmul
peak of the run's own dtype, peak RSS and PSS; each lightalign variant against TRL at the same precision; best vs
best over all precisions with that pair's peak memory ratios); one table of all of them closes the run, followed by
the issue's targets; JSON goes to bench/results/suite.json (--sweep: suite_precision.json) and a bar chart of the
ratios to the same name, .png.

`--sweep` is the precision sweep's preset (SWEEP: per method its --steps and the variants that were each side's fastest in docs/performance.md; the `small` model,
the `uniform` shape, 2 repeats, no waiting for a quiet machine: pin it to a core nothing else runs on). `uniform` is
the held-out shape: every tuning measurement of docs/performance.md ran on `longtail` (or the shipped arithmetic /
chat data), none on `uniform`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distill  # noqa: E402
import dpo  # noqa: E402
import grpo  # noqa: E402
import harness  # noqa: E402
import kto_speed  # noqa: E402
import online_dpo  # noqa: E402
import rloo  # noqa: E402
import sft  # noqa: E402

BENCHMARKS = ("sft", "dpo", "grpo", "kto", "rloo", "online_dpo", "distill")
UNITS = {"sft": "tokens/s", "dpo": "pairs/s", "grpo": "completions/s", "kto": "rows/s", "rloo": "completions/s",
         "online_dpo": "steps/s", "distill": "steps/s"}
# Tiny settings of --quick: enough steps to start and stop the clock, nothing more.
QUICK = {
    "sft": ["--steps", "2", "--warmup", "1", "--batch-size", "2", "--max-length", "64", "--mean-length", "24"],
    "dpo": ["--steps", "2", "--warmup", "1", "--batch-size", "2", "--max-length", "64", "--mean-length", "16"],
    "grpo": ["--steps", "1", "--warmup", "1", "--generation-batch", "8", "--num-generations", "4", "--grad-accum",
             "2", "--max-completion-length", "8", "--mean-length", "12", "--retries", "0"],
    "kto": ["--steps", "2", "--warmup", "1", "--batch-size", "2", "--max-length", "64", "--mean-length", "16"],
    "rloo": ["--steps", "1", "--warmup", "1", "--generation-batch", "8", "--num-generations", "4", "--grad-accum",
             "2", "--max-completion-length", "8", "--mean-length", "12", "--retries", "0"],
    "online_dpo": ["--steps", "1", "--warmup", "1", "--batch-size", "2", "--max-new-tokens", "8", "--mean-length", "12",
                   "--variants", "lightalign:short", "trl:short"],
    "distill": ["--steps", "1", "--warmup", "1", "--batch-size", "2", "--max-new-tokens", "8", "--mean-length", "12",
                "--variants", "lightalign:lmbda0", "trl:lmbda0"],
}
# --sweep: the precision sweep (bench/sweep_precision.sh) on the held-out `uniform` shape, sized for about 40 minutes
# at one thread (2 repeats x 2 precisions x 2 frameworks; a run is ~15 s of start-up and loading plus its steps): per
# method its --steps and TRL's fastest CPU variant with its plain one where they differ (SFT group_by_length and
# padding, DPO best and DPOConfig defaults, GRPO generate and continuous batching); lightalign's fastest variant.
SWEEP = {
    "sft": ["--steps", "6", "--warmup", "2", "--variants", "padding_free", "group_by_length"],
    "dpo": ["--steps", "4", "--warmup", "1", "--modes", "online", "--prompt-sharing", "on", "--trl-config", "best"],
    "grpo": ["--steps", "2", "--warmup", "1", "--retries", "0", "--prompt-sharing", "off", "--variants",
             "lightalign:compact", "trl:generate"],
    "kto": ["--steps", "4", "--warmup", "1", "--modes", "online"],
    "rloo": ["--steps", "2", "--warmup", "1", "--retries", "0"],
    "online_dpo": ["--steps", "6", "--warmup", "1", "--variants", "lightalign:long", "trl:long"],
    "distill": ["--steps", "6", "--warmup", "1", "--variants", "lightalign:lmbda0.5", "trl:lmbda0.5"],
}
TARGETS = {"sft": 1.3, "dpo": 2.0, "grpo": 2.0, "sft_mfu": 0.5}  # issue #8, small model, long-tailed data
TARGETED = ("sft", "dpo", "grpo")  # the others (issues #24, #40, ...) have no target: measured, not held to a ratio


def model_dir(name: str) -> str:
    path = harness.ROOT / "assets" / "models" / name
    if path.is_dir():
        return str(path)
    if Path(name).is_dir():
        return str(Path(name).resolve())
    raise SystemExit(f"--models: {name!r} is neither a folder of assets/models/ nor a path to a model config folder.")


def namespace(module, argv: list[str], contention: float | None, peaks: dict | None = None):
    """The script's arguments parsed from ``argv``, with the suite's contention bound and its matmul peaks (measured
    once for the whole suite, so every script's efficiency uses the same ones)."""
    args = module.build_parser().parse_args(argv)
    args.max_contention = contention
    args.peaks = peaks
    return args


def rows_of(bench: str, report: dict, model: str, shape: str) -> list[dict]:
    """One row per variant of a benchmark's ``precision_report``: its figure, efficiency, peak RSS and PSS."""
    return [{"benchmark": bench, "model": model, "shape": shape, "variant": r["variant"],
             "framework": r["framework"], "precision": r["precision"], "unit": UNITS[bench],
             "figure": r[report["figure"]], "efficiency": r["efficiency"], "peak_rss_mb": r["peak_rss_mb"],
             "peak_pss_mb": r["peak_pss_mb"]} for r in report["variants"]]


def targets(reports: list[dict]) -> list[dict]:
    """The issue's targets, read from the `small` / `longtail` reports (best lightalign variant vs best TRL one over
    every precision; the padding-free pair and the MFU at fp32, as the targets were set)."""
    picked = {r["benchmark"]: r["report"] for r in reports if r["model"] == "small" and r["shape"] == "longtail"}
    out = []
    for bench in TARGETED:
        best = (picked.get(bench) or {}).get("best_vs_best") or {}
        out.append({"target": f"{bench} lightalign best / TRL best >= {TARGETS[bench]}x",
                    "value": best.get("ratio"), "threshold": TARGETS[bench]})
    pairs = (picked.get("sft") or {}).get("pairs", [])
    same = [p["vs_trl_same_setting"] for p in pairs if p["lightalign"] == "lightalign:padding_free@fp32"]
    out.append({"target": f"sft lightalign padding_free / TRL padding_free >= {TARGETS['sft']}x (same variant, fp32)",
                "value": same[0] if same else None, "threshold": TARGETS["sft"]})
    mfu = max((r["efficiency"] for r in (picked.get("sft") or {}).get("variants", [])
               if r["framework"] == "lightalign" and r["precision"] == "fp32" and r["efficiency"]), default=None)
    out.append({"target": f"sft lightalign MFU >= {TARGETS['sft_mfu']:.0%} of the fp32 matmul peak", "value": mfu,
                "threshold": TARGETS["sft_mfu"]})
    for t in out:
        t["met"] = None if t["value"] is None else t["value"] >= t["threshold"]
    return out


def print_table(rows: list[dict], reports: list[dict]) -> None:
    """Every variant of every method (figure, efficiency against its own precision's peak, peak RSS and PSS), then per
    method the lightalign / TRL pairs at the same precision and best vs best with its peak memory ratios."""
    f, pct = harness.fmt, lambda v: "-" if v is None else f"{100 * v:.1f}%"
    print("\n| benchmark | model | shape | variant | unit | figure | efficiency | peak RSS MB | peak PSS MB |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['benchmark']} | {r['model']} | {r['shape']} | {r['variant']} | {r['unit']} "
              f"| {f(r['figure'], '.3g')} | {pct(r['efficiency'])} | {f(r['peak_rss_mb'], '.0f')} "
              f"| {f(r['peak_pss_mb'], '.0f')} |")
    print("\nPairs at the same precision (lightalign / TRL):\n| benchmark | model | shape | lightalign | TRL same "
          "setting | ratio | TRL fastest | ratio |\n|---|---|---|---|---|---|---|---|")
    for rep in reports:
        for p in rep["report"]["pairs"]:
            print(f"| {rep['benchmark']} | {rep['model']} | {rep['shape']} | {p['lightalign']} "
                  f"| {p['trl_same_setting'] or '-'} | {f(p['vs_trl_same_setting'], '.2f')} | {p['trl_fastest'] or '-'} "
                  f"| {f(p['vs_trl_fastest'], '.2f')} |")
    print("\nBest vs best (each side's fastest variant over all precisions):\n| benchmark | model | shape | lightalign "
          "| TRL | ratio | peak RSS ratio | peak PSS ratio |\n|---|---|---|---|---|---|---|---|")
    for rep in reports:
        b = rep["report"]["best_vs_best"]
        if b:
            print(f"| {rep['benchmark']} | {rep['model']} | {rep['shape']} | {b['lightalign']} | {b['trl']} "
                  f"| {f(b['ratio'], '.2f')}x | {f(b['peak_rss_ratio'], '.2f')} | {f(b['peak_pss_ratio'], '.2f')} |")


def plot(payload: dict, out: Path) -> Path | None:
    """Horizontal bars: each lightalign variant over TRL's fastest at the same precision, a line at 1x (parity) and
    the issue's target per benchmark."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no chart: matplotlib is missing; install the benchmark extra (pip install -e '.[bench]') or run "
              f"`python bench/suite.py --plot-only {out.with_suffix('.json')}` where it is installed.")
        return None
    rows = [{"benchmark": rep["benchmark"], "label": f"{rep['benchmark']} {rep['model']} {rep['shape']} "
             f"{p['lightalign']} / {p['trl_fastest']}", "ratio": p["vs_trl_fastest"]}
            for rep in payload["reports"] for p in rep["report"]["pairs"] if p["vs_trl_fastest"] is not None]
    if not rows:
        print("no chart: no lightalign variant has a TRL figure at its precision.")
        return None
    colors = dict(zip(BENCHMARKS, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                                   "tab:olive")))
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.5))
    ax.barh(range(len(rows)), [r["ratio"] for r in rows], color=[colors[r["benchmark"]] for r in rows])
    for i, r in enumerate(rows):
        if r["benchmark"] not in TARGETED:
            continue
        ax.plot([TARGETS[r["benchmark"]]] * 2, [i - 0.4, i + 0.4], color="black", linestyle=":", linewidth=1)
    ax.axvline(1.0, color="grey", linewidth=1)
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("lightalign / TRL's fastest at the same precision (dotted: issue #8 target)")
    peaks = ", ".join(f"{p} {v:.0f}" for p, v in payload["matmul_peaks_gflops"].items())
    ax.set_title(f"lightalign vs TRL, matmul peaks {peaks} GFLOP/s, threads {payload['threads']}")
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny settings: a smoke run of the plumbing, not figures")
    p.add_argument("--sweep", action="store_true", help="the precision sweep's settings (SWEEP): small model, the "
                   "held-out uniform shape, 2 repeats, no contention wait; see bench/sweep_precision.sh")
    p.add_argument("--models", nargs="+", default=None, help="assets/models/<name> or config paths "
                   "(default: small medium; --sweep: small)")
    p.add_argument("--shapes", nargs="+", default=None, choices=["uniform", "longtail"],
                   help="default: uniform longtail; --sweep: uniform")
    p.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS), choices=BENCHMARKS)
    p.add_argument("--repeats", type=int, default=None, help="default 3; --sweep 2; --quick 1")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--precisions", nargs="+", choices=harness.PRECISIONS, default=None,
                   help="default: fp32 and bf16 where the CPU has native bf16, else fp32")
    p.add_argument("--max-contention", type=float, default=0.05,
                   help="wait before each run until other processes use less of the machine (--quick, --sweep: no "
                        "wait; a negative value: no wait)")
    p.add_argument("--matmul-n", type=int, default=4096, help="size of the square matmuls of the peaks")
    p.add_argument("--out", default=None, help="file name under bench/results/ (the chart: same, .png; default "
                   "suite.json, --sweep suite_precision.json)")
    p.add_argument("--plot-only", metavar="JSON", help="only redraw the chart of a suite.json")
    return p


def run_bench(bench: str, argv: list[str], contention: float | None, peaks: dict) -> dict:
    """One method's script on ``argv``; returns its result, with the ``precision_report`` over all its runs."""
    ns = lambda module, extra=(): namespace(module, argv + list(extra), contention, peaks)  # noqa: E731
    if bench == "sft":
        return sft.run(ns(sft))
    if bench == "dpo":
        extra = [] if "--prompt-sharing" in argv else ["--prompt-sharing", "on", "off"]
        return dpo.run(ns(dpo, extra + ([] if "--trl-config" in argv else ["--trl-config", "best", "defaults"])))
    if bench == "kto":
        return kto_speed.run(ns(kto_speed))
    if bench == "rloo":
        return rloo.run(ns(rloo))
    if bench == "online_dpo":
        return online_dpo.run(ns(online_dpo, ["--data", "english"]))
    if bench == "distill":
        return distill.run(ns(distill, ["--data", "english"]))
    if "--prompt-sharing" in argv:  # GRPO in one setting (--sweep: off)
        return grpo.run(ns(grpo))
    # GRPO: prompt_sharing off with TRL alongside, then on (lightalign only), its variants marked +prompt_sharing
    off = grpo.run(ns(grpo, ["--prompt-sharing", "off"]))
    on_args = ns(grpo, ["--prompt-sharing", "on"])
    on_args.variants = [v for v in (on_args.variants or ["lightalign:"]) if v.startswith("lightalign:")]
    on = grpo.run(on_args)
    for r in on["runs"]:
        r["variant"] = r["variant"].replace("@", "+prompt_sharing@")
    runs = off["runs"] + on["runs"]
    return {"runs": [off, on], "precision_report": harness.precision_report(runs, "completions_per_sec", peaks)}


def main() -> None:
    args = build_parser().parse_args()
    if args.plot_only:
        src = Path(args.plot_only)
        print(f"wrote {plot(json.loads(src.read_text()), src.with_suffix('.png'))}")
        return
    models = args.models or (["small"] if args.sweep else ["small", "medium"])
    shapes = args.shapes or (["uniform"] if args.sweep else ["uniform", "longtail"])
    repeats = 1 if args.quick else args.repeats or (2 if args.sweep else 3)
    contention = None if args.quick or args.sweep or args.max_contention < 0 else args.max_contention
    precisions = args.precisions or harness.default_precisions()
    out_name = args.out or ("suite_precision.json" if args.sweep else "suite.json")
    dirs = {name: model_dir(name) for name in models}
    harness.wait_for_quiet(contention)
    matmul_n = 1024 if args.quick else args.matmul_n
    peaks = harness.measure_peaks(precisions, n=matmul_n, threads=args.threads)
    print(harness.peaks_line(peaks, matmul_n), flush=True)
    settings = {"threads": args.threads, "repeats": repeats, "precisions": " / ".join(precisions) + " (lightalign "
                "bf16-mixed / 32-true, TRL bf16=True / False; everything else identical)",
                "gradient_checkpointing": "off on both sides", "quick": args.quick, "sweep": args.sweep,
                "matmul_peaks": harness.peaks_line(peaks, matmul_n),
                "efficiency": "model FLOPs / s over the matmul peak of the run's own dtype; model FLOPs = "
                              "6*N*tokens + 12*layers*hidden*seq^2 per sequence trained (a third of it for forward-only "
                              "passes), see bench/harness.py (distill counts none: no efficiency there)",
                "versions": harness.versions(), "cpu_count": os.cpu_count()}
    harness.print_settings("Benchmark suite: lightalign vs TRL", settings)
    started, rows, reports, details = time.time(), [], [], []
    for model, path in dirs.items():
        for shape in shapes:
            common = ["--model", path, "--threads", str(args.threads), "--repeats", str(repeats), "--precisions",
                      *precisions, "--shape", shape]
            for bench in args.benchmarks:
                extra = QUICK[bench] if args.quick else SWEEP[bench] if args.sweep else []
                print(f"\n===== {bench} / {model} / {shape} =====", flush=True)
                argv = common + extra
                if bench == "distill":  # teacher and student: --model is the student; the teacher stays `small`
                    argv = [a if a != "--model" else "--student" for a in argv]
                result = run_bench(bench, argv, contention, peaks)
                report = result["precision_report"]
                harness.print_precision_report(report, title=f"{bench} / {model} / {shape}: ")
                rows += rows_of(bench, report, model, shape)
                reports.append({"benchmark": bench, "model": model, "shape": shape, "report": report})
                details.append({"benchmark": bench, "model": model, "shape": shape, **result})
    print_table(rows, reports)
    checks = targets(reports)
    print("\nTargets (issue #8; small model, long-tailed data):")
    for t in checks:
        verdict = {None: "not measured", True: "met", False: "NOT met"}[t["met"]]
        print(f"  {t['target']}: {harness.fmt(t['value'], '.2f')} -> {verdict}")
    if args.quick:
        print("  (--quick: tiny settings on a possibly busy machine; these figures say nothing about performance)")
    payload = {"settings": settings, "matmul_peaks_gflops": {p: v / 1e9 for p, v in peaks.items()},
               "threads": args.threads, "rows": rows, "reports": reports, "targets": checks, "details": details,
               "wall_seconds": time.time() - started}
    out = harness.write_json(out_name, payload)
    print(f"\nwrote {out.relative_to(harness.ROOT)}  ({(time.time() - started) / 60:.1f} min)")
    png = plot(payload, out.with_suffix(".png"))
    if png:
        print(f"wrote {png.relative_to(harness.ROOT)}")


if __name__ == "__main__":
    main()
