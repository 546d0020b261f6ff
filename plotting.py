"""Learning curves of runs as one PNG: ``lightalign plot RUN_DIR [RUN_DIR ...] [--metrics ...] [--out curves.png]``.

A run folder is what a logger wrote (``runs/<name>/version_N``): its ``metrics.csv`` (CSVLogger) is read, or its
TensorBoard event files. Pointing at ``runs/<name>`` picks the newest ``version_N``. One panel per quantity:
``train/loss`` and ``val/loss`` share the "loss" panel; several runs are drawn on the same panels to compare them.
matplotlib is an optional extra (``pip install 'lightalign[plot]'``); the figure is drawn headless (Agg).
"""

from __future__ import annotations

import argparse
import csv
import math
import re
from pathlib import Path
from typing import Any, Sequence

Curves = dict[str, list[tuple[int, float]]]

#: Default selection per method (whatever of these a run logged, in this order), then the learning rate.
DEFAULT_METRICS = {
    "grpo": ["train/reward/mean", "val/reward/mean", "train/loss", "train/kl", "train/completions/mean_length",
             "train/entropy"],
    "dpo": ["train/loss", "val/loss", "train/rewards/accuracies", "val/rewards/accuracies", "train/rewards/margins",
            "val/rewards/margins", "train/rewards/chosen", "train/rewards/rejected"],
    "sft": ["train/loss", "val/loss", "train/token_accuracy", "val/token_accuracy"],
}
REWARD_SUMMARIES = ("train/reward/mean", "train/reward/std")  # GRPO: the weighted sum over functions, its spread
FALLBACK_COUNT = "/fallbacks"  # GRPO with reward_fallback_value: reward/<name>/fallbacks counts substitutions, no reward
PANEL_WIDTH, PANEL_HEIGHT, DPI = 4.5, 3.2, 100  # inches per panel: a panel is 450 x 320 pixels
MAX_COLUMNS = 3


def _require_matplotlib():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("Plotting needs matplotlib: pip install 'lightalign[plot]'.") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def find_run_dir(path: str | Path) -> Path:
    """The folder holding a run's metrics: ``path`` itself, or its newest ``version_N`` subfolder."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"Run folder {path} does not exist. Pass a folder such as runs/quickstart/version_0.")
    if (path / "metrics.csv").is_file() or any(path.glob("events.out.tfevents.*")):
        return path
    versions = [p for p in path.glob("version_*") if p.is_dir() and p.name[8:].isdigit()]
    if versions:
        return max(versions, key=lambda p: int(p.name[8:]))
    raise FileNotFoundError(
        f"No metrics in {path}: expected a metrics.csv (CSVLogger) or TensorBoard event files there or in a "
        "version_N subfolder. Point at the folder of one run, e.g. runs/quickstart/version_0."
    )


def read_csv_metrics(path: str | Path) -> Curves:
    """``{name: [(step, value), ...]}`` from a CSVLogger ``metrics.csv`` (empty cells skipped)."""
    curves: Curves = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            for name, value in row.items():
                if name in ("step", "epoch") or value in ("", None) or step in ("", None):
                    continue
                curves.setdefault(name, []).append((int(float(step)), float(value)))
    return curves


def read_tensorboard_metrics(run_dir: str | Path) -> Curves:
    """``{name: [(step, value), ...]}`` from the TensorBoard event files of a folder."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as err:
        raise ImportError("Reading TensorBoard runs needs tensorboard: pip install 'lightalign[loggers]'.") from err
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def read_run_metrics(path: str | Path) -> Curves:
    run_dir = find_run_dir(path)
    if (run_dir / "metrics.csv").is_file():
        return read_csv_metrics(run_dir / "metrics.csv")
    return read_tensorboard_metrics(run_dir)


def reward_function_metrics(available: Sequence[str]) -> list[str]:
    """GRPO's per-function rewards (``train/reward/<name>``), sorted; not the weighted mean or its spread, nor the
    fallback counts."""
    return sorted(m for m in available if m.startswith("train/reward/") and m not in REWARD_SUMMARIES
                  and not m.endswith(FALLBACK_COUNT))


def default_metrics(available: Sequence[str]) -> list[str]:
    """What to draw when no ``--metrics`` are given: the method's usual curves (GRPO: each reward function too,
    so one sees which moved), then the learning rate."""
    names = set(available)
    method = "grpo" if "train/reward/mean" in names else "dpo" if "train/rewards/margins" in names else "sft"
    chosen = [m for m in DEFAULT_METRICS[method] if m in names]
    if method == "grpo":
        at = chosen.index("train/reward/mean") + 1 + ("val/reward/mean" in chosen)
        chosen[at:at] = reward_function_metrics(names)
    chosen += sorted(m for m in names if m.startswith("lr-"))[:1]
    return chosen or sorted(names)


def panel_of(metric: str) -> str:
    """Metrics that differ only by stage (``train/loss``, ``val/loss``) share a panel; GRPO's per-function rewards
    share one panel ("reward per function"), and so do their fallback counts ("reward fallbacks per function")."""
    name = re.sub(r"^(train|val|test)/", "", metric)
    if name.startswith("reward/") and name.endswith(FALLBACK_COUNT):
        return "reward fallbacks per function"
    if name.startswith("reward/") and f"train/{name}" not in REWARD_SUMMARIES:
        return "reward per function"
    return name


def plot_runs(run_dirs: Sequence[str | Path], metrics: Sequence[str] | None = None, out: str | Path | None = None,
              labels: Sequence[str] | None = None) -> Any:
    """Draw the curves of one or several runs; save a PNG to ``out`` when given; return the matplotlib Figure.

    Each metric of each run is one line; the figure is ``PANEL_WIDTH x PANEL_HEIGHT`` inches per panel at ``DPI``.
    """
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run folder.")
    runs = [(Path(d), read_run_metrics(d)) for d in run_dirs]
    labels = list(labels) if labels is not None else _run_labels([find_run_dir(d) for d in run_dirs])
    if metrics is None or len(metrics) == 0:
        metrics = default_metrics(sorted({name for _, curves in runs for name in curves}))
    for metric in metrics:
        if not any(metric in curves for _, curves in runs):
            available = sorted({name for _, curves in runs for name in curves})
            raise ValueError(f"Metric {metric!r} was not logged by {', '.join(str(d) for d, _ in runs)}. "
                             f"Logged metrics: {', '.join(available)}.")
    return draw(runs=[curves for _, curves in runs], labels=labels, metrics=list(metrics), out=out)


def draw(runs: Sequence[Curves], labels: Sequence[str], metrics: Sequence[str], out: str | Path | None = None) -> Any:
    plt = _require_matplotlib()
    panels = list(dict.fromkeys(panel_of(m) for m in metrics))
    ncols = min(MAX_COLUMNS, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(PANEL_WIDTH * ncols, PANEL_HEIGHT * nrows), dpi=DPI,
                             squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, panel in enumerate(panels):
        ax = axes[index // ncols][index % ncols]
        for run_index, (curves, label) in enumerate(zip(runs, labels)):
            for metric_index, metric in enumerate(m for m in metrics if panel_of(m) == panel):
                points = sorted(curves.get(metric, []))
                if not points:
                    continue
                steps, values = zip(*points)
                sparse = len(points) <= 20 or metric.startswith(("val/", "test/"))
                name = metric if len(runs) == 1 else f"{label}: {metric}"
                color = colors[(run_index if len(runs) > 1 else metric_index) % len(colors)]  # per run, or metric
                ax.plot(steps, values, label=name, color=color,
                        linestyle="--" if metric.startswith("val/") else "-", marker="o" if sparse else None,
                        markersize=3)
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for index in range(len(panels), nrows * ncols):
        axes[index // ncols][index % ncols].set_visible(False)
    fig.tight_layout()
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return fig


def _run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """Short distinct names: the last two parts of each run folder (``name/version_N``), more if they collide."""
    for depth in range(2, max(len(d.resolve().parts) for d in run_dirs) + 1):
        labels = ["/".join(d.resolve().parts[-depth:]) for d in run_dirs]
        if len(set(labels)) == len(labels):
            return labels
    return [str(d) for d in run_dirs]


def plot_from_args(args: Sequence[str] | None = None) -> Any:
    """``lightalign plot`` without the exit status: parse, draw, save; return the matplotlib Figure."""
    parser = argparse.ArgumentParser(prog="lightalign plot", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders (runs/<name>/version_N)")
    parser.add_argument("--metrics", nargs="+", default=None,
                        help="metric names as logged (train/loss val/loss lr-AdamW ...); default: per method")
    parser.add_argument("--out", default=None,
                        help="PNG path; default: RUN_DIR/curves.png for one run, else curves.png")
    parsed = parser.parse_args(args)
    out = Path(parsed.out) if parsed.out else (
        find_run_dir(parsed.run_dirs[0]) / "curves.png" if len(parsed.run_dirs) == 1 else Path("curves.png"))
    figure = plot_runs(parsed.run_dirs, metrics=parsed.metrics, out=out)
    print(f"Learning curves written to {out}")
    return figure


def main(args: Sequence[str] | None = None) -> int:
    """``lightalign plot``: 0 once the PNG is written (errors raise; the ``lightalign`` entry point prints them)."""
    plot_from_args(args)
    return 0
