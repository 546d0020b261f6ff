"""The benchmark suite: SFT, DPO, GRPO, KTO and RLOO, lightalign vs TRL, over models x data shapes, in one command.

    python bench/suite.py                                   # the real run (quiet machine, ~hours on 2 cores)
    python bench/suite.py --quick --models tiny             # smoke run: tiny settings, proves the plumbing
    python bench/suite.py --models small --shapes longtail  # the rows the targets are read from
    python bench/suite.py --plot-only bench/results/suite.json   # redraw the chart (needs only matplotlib)

Needs the benchmark extra (`pip install -e '.[bench]'`: TRL + matplotlib; `make bench` builds a separate venv).
First the machine's fp32 matmul peak is measured (harness.measure_matmul_flops); then for each model and data
shape (bench/data.py) it runs bench/sft.py (padding / padding_free / packing / group_by_length), bench/dpo.py
(online / precomputed reference, lightalign prompt_sharing on / off, TRL at its best CPU settings and at its
DPOConfig defaults), bench/grpo.py (lightalign prompt_sharing off alternating with TRL, then on), bench/kto_speed.py
(online / precomputed reference) and bench/rloo.py, each run in its own process, frameworks alternating, medians over
--repeats.
One table closes the run (per row: the figure of each side, the ratio, MFU = model FLOP/s over the matmul peak,
peak RSS), followed by the issue's targets; JSON goes to bench/results/suite.json and a bar chart of the ratios
to bench/results/suite.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dpo  # noqa: E402
import grpo  # noqa: E402
import harness  # noqa: E402
import kto_speed  # noqa: E402
import rloo  # noqa: E402
import sft  # noqa: E402

BENCHMARKS = ("sft", "dpo", "grpo", "kto", "rloo")
# Tiny settings of --quick: enough steps to start and stop the clock, nothing more.
QUICK = {
    "sft": ["--steps", "2", "--warmup", "1", "--batch-size", "2", "--max-length", "64", "--mean-length", "24"],
    "dpo": ["--steps", "2", "--warmup", "1", "--batch-size", "2", "--max-length", "64", "--mean-length", "16"],
    "grpo": ["--steps", "1", "--warmup", "1", "--generation-batch", "8", "--num-generations", "4", "--grad-accum",
             "2", "--max-completion-length", "8", "--mean-length", "12", "--retries", "0"],
    "kto": ["--steps", "2", "--warmup", "1", "--batch-size", "2", "--max-length", "64", "--mean-length", "16"],
    "rloo": ["--steps", "1", "--warmup", "1", "--generation-batch", "8", "--num-generations", "4", "--grad-accum",
             "2", "--max-completion-length", "8", "--mean-length", "12", "--retries", "0"],
}
TARGETS = {"sft": 1.3, "dpo": 2.0, "grpo": 2.0, "sft_mfu": 0.5}  # issue #8, small model, long-tailed data
TARGETED = ("sft", "dpo", "grpo")  # KTO and RLOO (issue #24) have no target: measured against TRL, not held to a ratio


def model_dir(name: str) -> str:
    path = harness.ROOT / "assets" / "models" / name
    if path.is_dir():
        return str(path)
    if Path(name).is_dir():
        return str(Path(name).resolve())
    raise SystemExit(f"--models: {name!r} is neither a folder of assets/models/ nor a path to a model config folder.")


def namespace(module, argv: list[str], contention: float | None):
    args = module.build_parser().parse_args(argv)
    args.max_contention = contention
    return args


def rows_of(bench: str, result: dict, model: str, shape: str, peak: float) -> list[dict]:
    """One uniform row per variant: figure of each side, ratio, MFU, peak RSS."""
    out = []

    def row(variant, unit, la, tr, la_flops, tr_flops, la_rss, tr_rss, note=None, gemm_shares=(None, None)):
        out.append({"benchmark": bench, "model": model, "shape": shape, "variant": variant, "unit": unit, "note": note,
                    "lightalign": la, "trl": tr, "ratio": harness.ratio(la, tr),
                    "lightalign_mfu": harness.mfu(la_flops, peak), "trl_mfu": harness.mfu(tr_flops, peak),
                    "lightalign_gemm_share": gemm_shares[0], "trl_gemm_share": gemm_shares[1],
                    "lightalign_peak_rss_mb": la_rss, "trl_peak_rss_mb": tr_rss})

    if bench == "sft":
        for r in result["summary"]:
            row(r["variant"], "tokens/s", r.get("lightalign_tokens_per_sec"), r.get("trl_tokens_per_sec"),
                r.get("lightalign_model_flops_per_sec"), r.get("trl_model_flops_per_sec"),
                r.get("lightalign_peak_rss_mb"), r.get("trl_peak_rss_mb"),
                r.get("lightalign_unavailable") or r.get("trl_unavailable"),
                (r.get("lightalign_gemm_share"), r.get("trl_gemm_share")))
    elif bench == "dpo":
        for r in result["summary"]:
            row(f"{r['mode']} ref, prompt_sharing {r['prompt_sharing']}, TRL {r['trl_config']}", "pairs/s",
                r["lightalign_pairs_per_sec"], r["trl_pairs_per_sec"], r["lightalign_model_flops_per_sec"],
                r["trl_model_flops_per_sec"], r["lightalign_peak_rss_mb"], r["trl_peak_rss_mb"])
    elif bench == "kto":
        for r in result["summary"]:
            row(f"{r['mode']} ref", "rows/s", r["lightalign_rows_per_sec"], r["trl_rows_per_sec"],
                r["lightalign_model_flops_per_sec"], r["trl_model_flops_per_sec"], r["lightalign_peak_rss_mb"],
                r["trl_peak_rss_mb"])
    elif bench == "rloo":
        la, tr = (result["summary"].get(fw, {}) for fw in harness.FRAMEWORKS)
        row("generate + train", "completions/s", la.get("completions_per_sec"), tr.get("completions_per_sec"),
            la.get("model_flops_per_sec"), tr.get("model_flops_per_sec"), la.get("peak_rss_mb"), tr.get("peak_rss_mb"))
    else:  # one result per lightalign prompt_sharing setting; TRL ran alongside the first (see main)
        tr = result["runs"][0]["summary"].get("trl", {})
        for sharing, res in zip(("off", "on"), result["runs"]):
            la = res["summary"].get("lightalign", {})
            row(f"generate + train, prompt_sharing {sharing}", "completions/s", la.get("completions_per_sec"),
                tr.get("completions_per_sec"), la.get("model_flops_per_sec"), tr.get("model_flops_per_sec"),
                la.get("peak_rss_mb"), tr.get("peak_rss_mb"))
    return out


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, read from the `small` / `longtail` rows (best lightalign variant vs best TRL one)."""
    picked = [r for r in rows if r["model"] == "small" and r["shape"] == "longtail"]
    out = []
    for bench in TARGETED:
        mine = [r for r in picked if r["benchmark"] == bench]
        la = max((r["lightalign"] for r in mine if r["lightalign"]), default=None)
        tr = max((r["trl"] for r in mine if r["trl"]), default=None)
        out.append({"target": f"{bench} lightalign best / TRL best >= {TARGETS[bench]}x",
                    "value": harness.ratio(la, tr), "threshold": TARGETS[bench]})
    same = [r["ratio"] for r in picked if r["benchmark"] == "sft" and r["variant"] == "padding_free" and r["ratio"]]
    out.append({"target": f"sft lightalign padding_free / TRL padding_free >= {TARGETS['sft']}x (same variant)",
                "value": same[0] if same else None, "threshold": TARGETS["sft"]})
    mfu = max((r["lightalign_mfu"] for r in picked if r["benchmark"] == "sft" and r["lightalign_mfu"]), default=None)
    out.append({"target": f"sft lightalign MFU >= {TARGETS['sft_mfu']:.0%} of the matmul peak", "value": mfu,
                "threshold": TARGETS["sft_mfu"]})
    for t in out:
        t["met"] = None if t["value"] is None else t["value"] >= t["threshold"]
    return out


def print_table(rows: list[dict]) -> None:
    f, pct = harness.fmt, lambda v: "-" if v is None else f"{100 * v:.1f}%"
    print("\n| benchmark | model | shape | variant | unit | lightalign | TRL | ratio | MFU lightalign | MFU TRL "
          "| peak RSS MB lightalign | peak RSS MB TRL |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['benchmark']} | {r['model']} | {r['shape']} | {r['variant']} | {r['unit']} "
              f"| {f(r['lightalign'], '.2f')} | {f(r['trl'], '.2f')} | {f(r['ratio'], '.2f')}{'x' if r['ratio'] else ''} "
              f"| {pct(r['lightalign_mfu'])} | {pct(r['trl_mfu'])} | {f(r['lightalign_peak_rss_mb'], '.0f')} "
              f"| {f(r['trl_peak_rss_mb'], '.0f')} |" + (f" n/a: {r['note']}" if r.get("note") else ""))
    shares = [r for r in rows if r.get("lightalign_gemm_share") or r.get("trl_gemm_share")]
    if shares:
        print("\nSFT GEMM share (the linear layers' matrix products alone, timed bare, over the wall time):\n"
              "| model | shape | variant | lightalign | TRL |\n|---|---|---|---|---|")
        for r in shares:
            print(f"| {r['model']} | {r['shape']} | {r['variant']} | {pct(r['lightalign_gemm_share'])} "
                  f"| {pct(r['trl_gemm_share'])} |")


def plot(payload: dict, out: Path) -> Path | None:
    """Horizontal bars: lightalign / TRL per row, a line at 1x (parity) and the issue's target per benchmark."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no chart: matplotlib is missing; install the benchmark extra (pip install -e '.[bench]') or run "
              f"`python bench/suite.py --plot-only {out.with_suffix('.json')}` where it is installed.")
        return None
    rows = [r for r in payload["rows"] if r["ratio"] is not None]
    if not rows:
        print("no chart: no row has both a lightalign and a TRL figure.")
        return None
    colors = {"sft": "tab:blue", "dpo": "tab:orange", "grpo": "tab:green", "kto": "tab:red", "rloo": "tab:purple"}
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    labels = [f"{r['benchmark']} {r['model']} {r['shape']} {r['variant']}" for r in rows]
    ax.barh(range(len(rows)), [r["ratio"] for r in rows], color=[colors[r["benchmark"]] for r in rows])
    for i, r in enumerate(rows):
        if r["benchmark"] not in TARGETED:
            continue
        ax.plot([TARGETS[r["benchmark"]]] * 2, [i - 0.4, i + 0.4], color="black", linestyle=":", linewidth=1)
    ax.axvline(1.0, color="grey", linewidth=1)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("lightalign / TRL throughput (dotted: issue #8 target)")
    ax.set_title(f"lightalign vs TRL, matmul peak {payload['matmul_peak_gflops']:.0f} GFLOP/s, "
                 f"threads {payload['threads']}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny settings: a smoke run of the plumbing, not figures")
    p.add_argument("--models", nargs="+", default=["small", "medium"], help="assets/models/<name> or config paths")
    p.add_argument("--shapes", nargs="+", default=["uniform", "longtail"], choices=["uniform", "longtail"])
    p.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS), choices=BENCHMARKS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-contention", type=float, default=0.05,
                   help="wait before each run until other processes use less of the machine (--quick: no wait)")
    p.add_argument("--matmul-n", type=int, default=4096, help="size of the square fp32 matmul of the peak")
    p.add_argument("--out", default="suite.json", help="file name under bench/results/ (the chart: same, .png)")
    p.add_argument("--plot-only", metavar="JSON", help="only redraw the chart of a suite.json")
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.plot_only:
        src = Path(args.plot_only)
        print(f"wrote {plot(json.loads(src.read_text()), src.with_suffix('.png'))}")
        return
    contention = None if args.quick else args.max_contention
    repeats = 1 if args.quick else args.repeats
    dirs = {name: model_dir(name) for name in args.models}
    harness.wait_for_quiet(contention)
    peak = harness.measure_matmul_flops(n=1024 if args.quick else args.matmul_n, threads=args.threads)
    settings = {"threads": args.threads, "repeats": repeats, "precision": "fp32 on both sides",
                "gradient_checkpointing": "off on both sides", "quick": args.quick,
                "matmul_peak": f"{peak / 1e9:.1f} GFLOP/s (fp32 torch.mm, n={1024 if args.quick else args.matmul_n})",
                "mfu": "model FLOPs / s over the matmul peak; model FLOPs = 6*N*tokens + 12*layers*hidden*seq^2 "
                       "per sequence trained (a third of it for forward-only passes), see bench/harness.py",
                "gemm_share": "SFT only: the time the linear layers' matrix products alone take for the run's "
                              "micro-batches (bare torch.mm, best of 3) over the run's wall time",
                "versions": harness.versions(), "cpu_count": os.cpu_count()}
    harness.print_settings("Benchmark suite: lightalign vs TRL", settings)
    started, rows, details = time.time(), [], []
    for model, path in dirs.items():
        for shape in args.shapes:
            common = ["--model", path, "--threads", str(args.threads), "--repeats", str(repeats)]
            for bench in args.benchmarks:
                quick = QUICK[bench] if args.quick else []
                print(f"\n===== {bench} / {model} / {shape} =====", flush=True)
                if bench == "sft":
                    result = sft.run(namespace(sft, common + quick + ["--shape", shape], contention))
                elif bench == "dpo":
                    result = dpo.run(namespace(dpo, common + quick + ["--shape", shape, "--prompt-sharing", "on",
                                                                       "off", "--trl-config", "best", "defaults"],
                                               contention))
                elif bench == "kto":
                    result = kto_speed.run(namespace(kto_speed, common + quick + ["--shape", shape], contention))
                elif bench == "rloo":
                    result = rloo.run(namespace(rloo, common + quick + ["--shape", shape], contention))
                else:  # prompt_sharing off: both frameworks alternating; on: lightalign only, right after
                    argv = common + quick + ["--shape", shape]
                    result = {"runs": [grpo.run(namespace(grpo, argv + ["--prompt-sharing", "off"], contention)),
                                       grpo.run(namespace(grpo, argv + ["--prompt-sharing", "on", "--frameworks",
                                                                        "lightalign"], contention))]}
                rows += rows_of(bench, result, model, shape, peak)
                details.append({"benchmark": bench, "model": model, "shape": shape, **result})
    print_table(rows)
    checks = targets(rows)
    print("\nTargets (issue #8; small model, long-tailed data):")
    for t in checks:
        verdict = {None: "not measured", True: "met", False: "NOT met"}[t["met"]]
        print(f"  {t['target']}: {harness.fmt(t['value'], '.2f')} -> {verdict}")
    if args.quick:
        print("  (--quick: tiny settings on a possibly busy machine; these figures say nothing about performance)")
    payload = {"settings": settings, "matmul_peak_gflops": peak / 1e9, "threads": args.threads, "rows": rows,
               "targets": checks, "details": details, "wall_seconds": time.time() - started}
    out = harness.write_json(args.out, payload)
    print(f"\nwrote {out.relative_to(harness.ROOT)}")
    png = plot(payload, out.with_suffix(".png"))
    if png:
        print(f"wrote {png.relative_to(harness.ROOT)}")


if __name__ == "__main__":
    main()
