"""Shared plumbing of the benchmarks (bench/sft.py, dpo.py, grpo.py, suite.py).

* one run = one process (``spawn``): the child prints a single ``RESULT {json}`` line, so its peak RSS
  (``ru_maxrss``) is its own and nothing (caches, allocator state) leaks from one run into the next;
* frameworks alternate between repeats (``alternate``) and figures are medians (``median_of``);
* on a shared machine a run waits for a quiet machine first (``wait_for_quiet``) and reports the CPU share other
  processes took during its timed window (``machine_busy_seconds``);
* the physical limit: ``measure_matmul_flops`` times a large ``torch.mm`` (fp32, or bf16: ``measure_peaks`` gives one
  per precision), and ``train_flops`` / ``mfu`` turn a throughput into model FLOPs utilisation against it;
  ``efficiency`` divides by the peak of the run's own precision;
* precision is a dimension of every variant: ``framework:setting[+suffix...][@fp32|@bf16]`` (``parse_variant``; no
  ``@``: each of ``--precisions``, ``expand_precisions``), lightalign ``bf16-mixed`` / ``32-true``, TRL ``bf16=True``
  / ``False``; ``precision_report`` gives every variant's figure, efficiency and peak memory, the lightalign / TRL
  pairs at the same precision, and best vs best over all precisions.

MFU formula (model FLOPs, i.e. the work the model needs, not what a framework happens to compute):

    train_flops(sequence of length s) = 6 * N * s + 12 * L * d * s**2

``N`` = parameters (tied embeddings counted once: the output projection is a real matmul, the embedding lookup is
not), ``L`` = layers, ``d`` = hidden size. ``6N`` per token is forward (2N) + backward (4N); the attention term is
the QK^T and AV matmuls, 2 * 2 * s**2 * d per layer forward, times 3 for forward + backward, counted without the
causal halving (the PaLM convention). A forward-only pass (DPO's reference model, GRPO's generation) is a third:
``forward_flops = 2 * N * s + 4 * L * d * s**2``. Padding is never counted: s is a sequence's real length.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FRAMEWORKS = ("lightalign", "trl")


# --------------------------------------------------------------------------- processes and the machine


def machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine have used (Linux /proc/stat); NaN elsewhere."""
    try:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def wait_for_quiet(max_share: float | None, timeout: float = 900.0) -> float:
    """Wait until other processes use at most ``max_share`` of the machine over 5 s (or ``timeout`` s pass).

    Returns the last measured share. ``max_share=None`` does not wait.
    """
    if max_share is None:
        return float("nan")
    deadline = time.time() + timeout
    while True:
        busy, start = machine_busy_seconds(), time.time()
        time.sleep(5)
        share = (machine_busy_seconds() - busy) / ((time.time() - start) * (os.cpu_count() or 1))
        if not share > max_share or time.time() > deadline:  # NaN (no /proc/stat): do not wait
            return share


def wait_for_load(max_load: float | None, timeout: float = 900.0) -> None:
    """Wait (up to ``timeout`` s) until the 1-minute load average drops below ``max_load`` (None: do not wait)."""
    deadline = time.monotonic() + timeout
    while max_load is not None and os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(10)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def pss_mb(pid: int | None = None) -> float:
    """Proportional set size of a process and all its descendants (a page shared by n processes counts 1/n in
    each, so the sum counts it once: the memory the run really holds, where summed RSS counts shared weights twice)."""
    total = 0
    for proc in _descendants(os.getpid() if pid is None else pid):
        try:
            for line in Path(f"/proc/{proc}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


class PeakPSS:
    """The peak of ``pss_mb`` over a run, sampled every ``interval`` seconds on a background thread."""

    def __init__(self, interval: float = 0.25) -> None:
        import threading

        self.peak, self.interval = 0.0, interval
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.peak = max(self.peak, pss_mb())

    def stop(self) -> float:
        self.stopped.set()
        self.thread.join()
        self.peak = max(self.peak, pss_mb())
        return self.peak


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Window:
    """The timed window of a run: wall seconds, and the share of the machine other processes used meanwhile."""

    def __init__(self) -> None:
        self.wall = self.cpu = self.busy = None
        self.seconds = self.others_cpu_share = None

    def start(self) -> None:
        self.wall, self.cpu, self.busy = time.perf_counter(), time.process_time(), machine_busy_seconds()

    def stop(self) -> None:
        self.seconds = time.perf_counter() - self.wall
        cpu, busy = time.process_time() - self.cpu, machine_busy_seconds() - self.busy
        self.others_cpu_share = max(0.0, busy - cpu) / (self.seconds * (os.cpu_count() or 1))

    @property
    def running(self) -> bool:
        return self.wall is not None and self.seconds is None


class StepWindow:
    """Times optimizer steps ``warmup + 1`` .. ``warmup + steps`` of a training run (``step_end`` called with the
    global step after each): wall seconds and this process's CPU seconds (all its threads) in that window."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.last = warmup, warmup + steps
        self.window = Window()
        self.cpu = 0.0

    def step_end(self, step: int) -> None:
        if step == self.warmup:
            self.window.start()
            self.cpu = time.process_time()
        elif step == self.last:
            self.window.stop()
            self.cpu = time.process_time() - self.cpu

    def timed(self, per_step: list) -> list:
        """The entries of ``per_step`` (one per optimizer step) inside the window, checked complete."""
        if self.window.seconds is None:
            raise RuntimeError(f"training stopped before optimizer step {self.last}: too few rows?")
        timed = per_step[self.warmup:self.last]
        if len(timed) != self.last - self.warmup:
            raise RuntimeError(f"{len(timed)} batches in a window of {self.last - self.warmup} optimizer steps.")
        return timed


def child_env(threads: int) -> dict[str, str]:
    return dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads), TQDM_DISABLE="1",
                HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_DISABLED="true", PYTHONWARNINGS="ignore")


def spawn(script: str | Path, argv: Sequence[str], threads: int, label: str) -> dict | None:
    """Run ``script --one argv...`` in a fresh interpreter; return its ``RESULT`` dict, or None (error printed)."""
    cmd = [sys.executable, str(script), "--one", *map(str, argv)]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=child_env(threads))
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        print(f"{label}: failed (exit {out.returncode})\n{out.stderr[-3000:]}", flush=True)
        return None
    # the process's whole wall time (start-up, loading, warm-up, timed steps): what a sweep's length is made of
    return {**json.loads(line[len("RESULT "):]), "run_wall_seconds": time.perf_counter() - start}


def measured_run(args: Any, meter: Any, train: Any) -> dict:
    """A child's run of ``args.framework`` on ``args.setting``: ``train(args, meter)`` (which returns extra fields) on
    ``args.threads`` threads with a datasets cache of its own (no cache hit across runs), and the figures: the
    meter's ``summary()``, peak RSS and peak PSS."""
    import torch

    torch.set_num_threads(args.threads)
    os.environ["HF_DATASETS_CACHE"] = str(Path(args.workdir) / f"datasets-{os.getpid()}")
    pss = PeakPSS()
    extra = train(args, meter)
    precision = getattr(args, "precision", None) or "fp32"
    return {"framework": args.framework, "setting": args.setting, "precision": precision,
            "variant": f"{args.framework}:{args.setting}@{precision}", **meter.summary(), "threads": args.threads, "peak_rss_mb": peak_rss_mb(), "peak_pss_mb": pss.stop(),
            **extra}


def emit(result: dict) -> None:
    """The child's side of ``spawn``."""
    print("RESULT " + json.dumps(result), flush=True)


def alternate(frameworks: Sequence[str], repeat: int) -> list[str]:
    """Framework order of repeat ``repeat`` (0-based): as given on even repeats, reversed on odd ones."""
    return list(frameworks) if repeat % 2 == 0 else list(frameworks)[::-1]


def median_of(runs: Iterable[dict], key: str, **match: Any) -> float | None:
    """Median of ``run[key]`` over the runs whose fields equal ``match`` (None values skipped)."""
    values = [r[key] for r in runs if all(r.get(k) == v for k, v in match.items()) and r.get(key) is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


# --------------------------------------------------------------------------- model


def build_model(config_dir: str | Path, out_dir: Path, seed: int) -> int:
    """Random weights from the config under a fixed seed, saved with the tokenizer files; returns the param count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(config_dir, out_dir)  # tokenizer + chat template + config + generation config
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def model_shape(config_dir: str | Path) -> dict:
    """Layers and hidden size from ``config.json`` (what the attention term of the FLOP count needs)."""
    cfg = json.loads((Path(config_dir) / "config.json").read_text())
    return {"layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"]}


# --------------------------------------------------------------------------- FLOPs


def measure_matmul_flops(n: int = 4096, threads: int | None = None, repeats: int = 5, dtype: Any = None) -> float:
    """FLOP/s of a square ``torch.mm`` of size ``n`` in ``dtype`` (default float32) on ``threads`` threads: the best
    of ``repeats`` timings.

    A matmul does 2 * n**3 FLOPs. One untimed warm-up call first. This is the machine's practical peak for the
    dense work of that dtype training is made of, measured in the same run as the benchmarks (bf16 products run
    on the CPU's bf16 units where it has them: a different peak from float32's).
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype

    if n < 64:
        raise ValueError(f"n={n} is too small to measure a peak; use 2048..4096.")
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
        out = torch.empty(n, n, dtype=dtype)
        torch.mm(a, b, out=out)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return 2 * n**3 / best


def train_flops(n_params: int, layers: int, hidden: int, lengths: Iterable[int]) -> float:
    """Model FLOPs of one forward + backward over sequences of these real lengths (formula: module docstring)."""
    lengths = list(lengths)
    return 6.0 * n_params * sum(lengths) + 12.0 * layers * hidden * sum(s * s for s in lengths)


def forward_flops(n_params: int, layers: int, hidden: int, lengths: Iterable[int]) -> float:
    """Model FLOPs of one forward pass over sequences of these real lengths (a third of ``train_flops``)."""
    return train_flops(n_params, layers, hidden, lengths) / 3.0


def linear_shapes(config_dir: str | Path) -> list[tuple[int, int, int]]:
    """``(in_features, out_features, count)`` of every linear layer of a decoder-only transformer, from its
    ``config.json``: per layer the q/k/v/o projections and a gated MLP (gate, up, down), then the output head."""
    cfg = json.loads((Path(config_dir) / "config.json").read_text())
    d, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or d // heads
    kv = cfg.get("num_key_value_heads") or heads
    ff = cfg["intermediate_size"]
    per_layer = [(d, heads * head_dim), (d, kv * head_dim), (d, kv * head_dim), (heads * head_dim, d),
                 (d, ff), (d, ff), (ff, d)]
    return [(i, o, layers) for i, o in per_layer] + [(d, cfg["vocab_size"], 1)]


def gemm_floor_seconds(config_dir: str | Path, batch_tokens: Iterable[int], repeats: int = 3,
                       cache: dict[int, float] | None = None, granularity: int = 16) -> float:
    """Time the matrix products of the linear layers alone would take to train ``batch_tokens`` (the real,
    non-padding token count of each micro-batch): per layer and micro-batch of ``M`` tokens, the forward
    ``x @ W.T`` and the two backward products (``dy @ W``, ``dy.T @ x``), each the best of ``repeats`` timings of
    a bare ``torch.mm`` into a preallocated output (so the allocator's state does not count) on the calling
    process's threads. ``M`` is timed rounded up to a multiple of ``granularity`` and scaled back linearly;
    ``cache`` (M -> seconds) shares timings between calls, so runs compared against each other share one floor.
    Attention scores, norms, activations, the loss and the optimizer are left out, so no training step can take
    less: a run's share of this floor (floor / its wall time) says how close it comes to the machine on the work
    every framework must do."""
    import torch

    gen = torch.Generator().manual_seed(0)
    shapes = linear_shapes(config_dir)
    cache = {} if cache is None else cache

    def best(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    def per_batch(m: int) -> float:
        total = 0.0
        for i, o, count in shapes:
            x, w, dy = (torch.randn(*shape, generator=gen) for shape in ((m, i), (o, i), (m, o)))
            y, dx, dw = torch.empty(m, o), torch.empty(m, i), torch.empty(o, i)
            total += count * (best(lambda: torch.mm(x, w.t(), out=y)) + best(lambda: torch.mm(dy, w, out=dx))
                              + best(lambda: torch.mm(dy.t(), x, out=dw)))
        return total

    floor = 0.0
    for m in batch_tokens:
        if m <= 0:
            continue
        timed = -(-m // granularity) * granularity
        if timed not in cache:
            cache[timed] = per_batch(timed)
        floor += cache[timed] * m / timed
    return floor


def mfu(flops_per_sec: float | None, peak_flops_per_sec: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the measured matmul peak."""
    if not flops_per_sec or not peak_flops_per_sec:
        return None
    return flops_per_sec / peak_flops_per_sec


def sequence_lengths(batch: Any) -> list[int]:
    """Real lengths of the sequences of a causal-LM batch: rows of a padded batch (``attention_mask`` sums), or the
    documents of a padding-free / packed row (runs of ``position_ids`` restarting at 0)."""
    if "attention_mask" in batch:
        return [int(n) for n in batch["attention_mask"].sum(-1).tolist() if n]
    if "position_ids" in batch:
        lengths = []
        for row in batch["position_ids"].tolist():
            for pos in row:
                if pos == 0:
                    lengths.append(0)
                lengths[-1] += 1
        return lengths
    return [int(batch["input_ids"].shape[-1])] * int(batch["input_ids"].shape[0])


# --------------------------------------------------------------------------- precision

PRECISIONS = ("fp32", "bf16")
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed"}


def split_precision(variant: str) -> tuple[str, str | None]:
    """``framework:setting[+suffix...][@fp32|@bf16]`` -> (the variant without its precision, the precision or None
    where it names none)."""
    base, at, precision = variant.partition("@")
    if at and precision not in PRECISIONS:
        raise SystemExit(f"--variants {variant!r}: the precision after @ is one of {list(PRECISIONS)} "
                         "(no @: every precision of --precisions).")
    return base, (precision if at else None)


def parse_variant(variant: str) -> dict:
    """The parts of ``framework:setting[+suffix...][@fp32|@bf16]``: framework, setting, suffixes (a list) and
    precision (fp32 where the variant names none)."""
    base, precision = split_precision(variant)
    framework, _, setting = base.partition(":")
    setting, *suffixes = setting.split("+")
    return {"framework": framework, "setting": setting, "suffixes": suffixes, "precision": precision or "fp32"}


def trl_same_setting(variant: str) -> str:
    """TRL's variant of the same setting and precision as ``variant``: ``trl:<setting>[@precision]`` (suffixes are
    lightalign's own; a variant naming no precision gets a name naming none)."""
    base, precision = split_precision(variant)
    setting = base.partition(":")[2].partition("+")[0]
    return f"trl:{setting}" + (f"@{precision}" if precision else "")


def default_precisions(flags: frozenset[str] | None = None) -> list[str]:
    """Both precisions where the CPU computes bf16 natively (``native_bf16``), else fp32 only (emulated bf16 is
    slower than fp32 there: nothing a user would pick)."""
    from lightalign.modules.training.cpu_bf16 import native_bf16

    return list(PRECISIONS) if native_bf16(flags) else ["fp32"]


def expand_precisions(variants: Sequence[str], precisions: Sequence[str]) -> list[str]:
    """Each variant without ``@`` once per precision (in ``precisions``' order), one with ``@`` as it is; every
    name in the result ends in its precision; duplicates dropped, first occurrence kept."""
    out: list[str] = []
    for variant in variants:
        base, precision = split_precision(variant)
        for p in [precision] if precision else precisions:
            if f"{base}@{p}" not in out:
                out.append(f"{base}@{p}")
    return out


def add_precision_arguments(parser: Any) -> None:
    """``--precisions`` (default: ``default_precisions``) and ``--matmul-n`` (the size of the peak's matmul), plus the
    hidden ``--precision`` of a child run."""
    import argparse

    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=None,
                        help="precisions of the variants given without @fp32/@bf16 (default: fp32 and bf16 where the "
                             "CPU has native bf16, else fp32): lightalign precision=bf16-mixed / 32-true, TRL "
                             "bf16=True / False, everything else identical")
    parser.add_argument("--matmul-n", type=int, default=4096, help="size of the square matmuls of the peaks")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help=argparse.SUPPRESS)


def resolve_precisions(args: Any) -> list[str]:
    """``args.precisions``, filled with ``default_precisions`` where not given."""
    if getattr(args, "precisions", None) is None:
        args.precisions = default_precisions()
    return args.precisions


def lightning_precision(precision: str | None) -> str:
    """Lightning's ``precision`` of a benchmark precision: ``bf16-mixed`` for bf16, ``32-true`` for fp32."""
    return LIGHTNING_PRECISION[precision or "fp32"]


def trl_bf16(precision: str | None) -> bool:
    """TRL's ``bf16`` of a benchmark precision (its fastest CPU setting is ``bf16=True, use_cpu=True``)."""
    return precision == "bf16"


def measure_peaks(precisions: Sequence[str], n: int = 4096, threads: int | None = None) -> dict[str, float]:
    """The matmul peak (``measure_matmul_flops``) of each precision's dtype, FLOP/s by precision name."""
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return {p: measure_matmul_flops(n=n, threads=threads, dtype=dtypes[p]) for p in precisions}


def peaks_of(args: Any) -> dict[str, float]:
    """``args.peaks`` where a caller (bench/suite.py) measured them, else measured now for ``args.precisions`` on
    ``args.threads`` threads and printed; stored on ``args``."""
    if getattr(args, "peaks", None) is None:
        args.peaks = measure_peaks(resolve_precisions(args), n=args.matmul_n, threads=args.threads)
        print(peaks_line(args.peaks, args.matmul_n), flush=True)
    return args.peaks


def peaks_line(peaks: dict[str, float], n: int) -> str:
    return "matmul peak: " + ", ".join(f"{p} {v / 1e9:.1f} GFLOP/s" for p, v in peaks.items()) + f" (torch.mm, n={n})"


def efficiency(flops_per_sec: float | None, precision: str | None, peaks: dict[str, float] | None) -> float | None:
    """A run's model FLOP/s over the matmul peak of its own precision's dtype (None without either)."""
    return mfu(flops_per_sec, (peaks or {}).get(precision or "fp32"))


def refused(variant: str) -> str | None:
    """Why lightalign refuses ``variant`` by design, or None: GRPO/RLOO sampling ahead (``+async<N>``, ``max_staleness``
    > 0) under bf16-mixed (the sampling process computes in the weights' float32, the policy under bf16 autocast)."""
    parts = parse_variant(variant)
    if (parts["framework"] == "lightalign" and parts["precision"] == "bf16"
            and any(s.startswith("async") and s != "async0" for s in parts["suffixes"])):
        return "max_staleness > 0 is refused under bf16-mixed by design"
    return None


def drop_refused(variants: Sequence[str]) -> list[str]:
    """``variants`` without those ``refused`` names, each left out with a printed note."""
    kept = []
    for variant in variants:
        why = refused(variant)
        if why:
            print(f"skipping {variant}: {why}", flush=True)
        else:
            kept.append(variant)
    return kept


REPORT_KEYS = ("model_flops_per_sec", "peak_rss_mb", "peak_pss_mb")


def precision_report(runs: Sequence[dict], figure: str, peaks: dict[str, float] | None) -> dict:
    """Per variant (``variant`` ends in its precision): the medians of ``figure``, model FLOP/s, peak RSS and PSS,
    and the efficiency (``efficiency``: against its own precision's peak); each lightalign variant paired with
    TRL at the same precision (its same setting where TRL ran it, and its fastest variant); and best vs best:
    lightalign's fastest variant over all precisions against TRL's fastest over all precisions, with the peak
    memory ratios of that pair."""
    rows: dict[str, dict] = {}
    for name in dict.fromkeys(r["variant"] for r in runs):
        parts = parse_variant(name)
        row = {"variant": name, **{k: parts[k] for k in ("framework", "setting", "precision")}}
        for key in (figure, *REPORT_KEYS):
            row[key] = median_of(runs, key, variant=name)
        if row[figure] is None:
            continue
        row["efficiency"] = efficiency(row["model_flops_per_sec"], parts["precision"], peaks)
        rows[name] = row

    def fastest(framework: str, **match: Any) -> dict | None:
        found = [r for r in rows.values() if r["framework"] == framework and all(r[k] == v for k, v in match.items())]
        return max(found, key=lambda r: r[figure], default=None)

    pairs = []
    for row in rows.values():
        if row["framework"] != "lightalign":
            continue
        same = fastest("trl", precision=row["precision"], setting=row["setting"])
        best = fastest("trl", precision=row["precision"])
        pairs.append({"lightalign": row["variant"], "precision": row["precision"],
                      "trl_same_setting": same and same["variant"],
                      "vs_trl_same_setting": same and ratio(row[figure], same[figure]),
                      "trl_fastest": best and best["variant"],
                      "vs_trl_fastest": best and ratio(row[figure], best[figure])})
    la, tr = fastest("lightalign"), fastest("trl")
    best_vs_best = None if la is None or tr is None else {
        "lightalign": la["variant"], "trl": tr["variant"], "ratio": ratio(la[figure], tr[figure]),
        "peak_rss_ratio": ratio(la["peak_rss_mb"], tr["peak_rss_mb"]),
        "peak_pss_ratio": ratio(la["peak_pss_mb"], tr["peak_pss_mb"])}
    return {"figure": figure, "peaks_gflops": {p: v / 1e9 for p, v in (peaks or {}).items()},
            "variants": list(rows.values()), "pairs": pairs, "best_vs_best": best_vs_best}


def print_precision_report(report: dict, title: str = "") -> None:
    """``precision_report`` as three tables: every variant, the pairs at the same precision, best vs best."""
    figure, pct = report["figure"], lambda v: fmt(None if v is None else 100 * v, ".1f") + ("%" if v else "")
    print(f"\n{title}every variant ({figure}; efficiency = model FLOP/s over the matmul peak of the run's own "
          f"dtype: {', '.join(f'{p} {v:.1f} GFLOP/s' for p, v in report['peaks_gflops'].items())})\n"
          f"| variant | {figure} | efficiency | peak RSS MB | peak PSS MB |\n|---|---|---|---|---|")
    for r in report["variants"]:
        print(f"| {r['variant']} | {fmt(r[figure], '.3g')} | {pct(r['efficiency'])} | {fmt(r['peak_rss_mb'], '.0f')} "
              f"| {fmt(r['peak_pss_mb'], '.0f')} |")
    if report["pairs"]:
        print("\n| lightalign variant | TRL same setting, same precision | ratio | TRL fastest, same precision "
              "| ratio |\n|---|---|---|---|---|")
        for p in report["pairs"]:
            print(f"| {p['lightalign']} | {p['trl_same_setting'] or '-'} | {fmt(p['vs_trl_same_setting'], '.2f')} "
                  f"| {p['trl_fastest'] or '-'} | {fmt(p['vs_trl_fastest'], '.2f')} |")
    b = report["best_vs_best"]
    if b:
        print(f"\nbest vs best (all precisions): {b['lightalign']} / {b['trl']} = {fmt(b['ratio'], '.2f')}x; "
              f"peak RSS ratio {fmt(b['peak_rss_ratio'], '.2f')}, peak PSS ratio {fmt(b['peak_pss_ratio'], '.2f')}",
              flush=True)


# --------------------------------------------------------------------------- command line


def add_run_arguments(parser: Any) -> None:
    """The arguments of a framework-against-framework benchmark that are not about the method: the timed window,
    repeats, threads, the optimiser's learning rate and clipping, the seed, and the hidden ``--one`` of a child run."""
    import argparse

    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps before the clock starts")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    add_precision_arguments(parser)


def check_variants(args: Any, settings: Sequence[str], backends: Sequence[str], options: Sequence[str] = ()) -> None:
    """``args.variants`` (``framework:setting``, lightalign's with optional ``+<sampler>`` and ``+<option>``
    suffixes, each with an optional ``@fp32`` / ``@bf16``) checked; None becomes every setting for both frameworks.
    Then expanded over ``args.precisions`` (``expand_precisions``), lightalign's variants refused in a precision
    dropped with a note (``drop_refused``). Also refuses ``--warmup`` < 1 (the clock starts at the end of that
    step)."""
    if args.variants is None:
        args.variants = [f"{fw}:{s}" for s in settings for fw in FRAMEWORKS]
    for variant in args.variants:
        framework, _, setting = split_precision(variant)[0].partition(":")
        setting, *suffixes = setting.split("+")
        if framework not in FRAMEWORKS or setting not in settings:
            raise SystemExit(f"--variants {variant!r}: use framework:setting with a framework of {list(FRAMEWORKS)} "
                             f"and a setting of {list(settings)}.")
        if any(framework != "lightalign" or s not in (*backends, *options) for s in suffixes):
            raise SystemExit(f"--variants {variant!r}: a +<backend> suffix is lightalign's sampler, one of "
                             f"{list(backends)} (TRL samples with generate)"
                             + (f"; other +<option> suffixes are lightalign's too: {list(options)}." if options
                                else "."))
    if args.warmup < 1:
        raise SystemExit("--warmup must be >= 1 (the clock starts at the end of optimizer step --warmup).")
    args.variants = drop_refused(expand_precisions(args.variants, resolve_precisions(args)))


def run_settings(args: Any) -> dict:
    """The settings ``add_run_arguments`` set, for ``print_settings`` (constant learning rate)."""
    return {"lr": f"{args.lr} constant", "max_grad_norm": args.max_grad_norm, "threads": args.threads,
            "precisions": f"{' / '.join(args.precisions)} (fp32: lightalign 32-true, TRL bf16=False; bf16: lightalign bf16-mixed, TRL bf16=True)",
            "warmup_steps": args.warmup, "timed_steps": args.steps, "repeats": args.repeats, "versions": versions()}


def interleaved_runs(args: Any, spawn_one: Any, describe: Any) -> list[dict]:
    """``args.repeats`` rounds over ``args.variants`` (order reversed on odd rounds), each run ``spawn_one(args,
    variant)`` in its own process; a run that failed is left out (its error printed); each finished one is printed
    as ``describe(result)``. Returns the results, each with its ``repeat`` (from 1)."""
    runs = []
    for r in range(args.repeats):
        for variant in alternate(args.variants, r):
            res = spawn_one(args, variant)
            if res is None:
                continue
            res["repeat"] = r + 1
            runs.append(res)
            print(f"[{r + 1}/{args.repeats}] {variant:>22}: {describe(res)}", flush=True)
    return runs


# --------------------------------------------------------------------------- printing


def print_settings(title: str, settings: dict) -> None:
    print(title + "\n" + "".join(f"  {key}: {value}\n" for key, value in settings.items()), flush=True)


def versions() -> str:
    import torch
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = "not installed (pip install -e '.[bench]')"
    import lightalign

    where = Path(lightalign.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "no git checkout"
    mine = "" if where == ROOT else f" (not this benchmark's checkout {ROOT}: set PYTHONPATH to measure it)"
    return (f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl_version}, lightalign "
            f"from {where} at {commit}{mine}")


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / name
    out.write_text(json.dumps(payload, indent=2))
    return out
