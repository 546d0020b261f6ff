"""Shared plumbing of the benchmarks (bench/sft.py, dpo.py, grpo.py, suite.py).

* one run = one process (``spawn``): the child prints a single ``RESULT {json}`` line, so its peak RSS
  (``ru_maxrss``) is its own and nothing (caches, allocator state) leaks from one run into the next;
* frameworks alternate between repeats (``alternate``) and figures are medians (``median_of``);
* on a shared machine a run waits for a quiet machine first (``wait_for_quiet``) and reports the CPU share other
  processes took during its timed window (``machine_busy_seconds``);
* the physical limit: ``measure_matmul_flops`` times a large fp32 ``torch.mm``, and ``train_flops`` /
  ``mfu`` turn a throughput into model FLOPs utilisation against it.

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
    out = subprocess.run(cmd, capture_output=True, text=True, env=child_env(threads))
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        print(f"{label}: failed (exit {out.returncode})\n{out.stderr[-3000:]}", flush=True)
        return None
    return json.loads(line[len("RESULT "):])


def measured_run(args: Any, meter: Any, train: Any) -> dict:
    """A child's run of ``args.framework`` on ``args.setting``: ``train(args, meter)`` (which returns extra fields) on
    ``args.threads`` threads with a datasets cache of its own (no cache hit across runs), and the figures: the
    meter's ``summary()``, peak RSS and peak PSS."""
    import torch

    torch.set_num_threads(args.threads)
    os.environ["HF_DATASETS_CACHE"] = str(Path(args.workdir) / f"datasets-{os.getpid()}")
    pss = PeakPSS()
    extra = train(args, meter)
    return {"framework": args.framework, "setting": args.setting, "variant": f"{args.framework}:{args.setting}",
            **meter.summary(), "threads": args.threads, "peak_rss_mb": peak_rss_mb(), "peak_pss_mb": pss.stop(),
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


def measure_matmul_flops(n: int = 4096, threads: int | None = None, repeats: int = 5) -> float:
    """fp32 FLOP/s of a square ``torch.mm`` of size ``n`` on ``threads`` threads: the best of ``repeats`` timings.

    A matmul does 2 * n**3 FLOPs. One untimed warm-up call first. This is the machine's practical peak for the
    dense fp32 work training is made of, measured in the same run as the benchmarks.
    """
    import torch

    if n < 64:
        raise ValueError(f"n={n} is too small to measure a peak; use 2048..4096.")
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
        out = torch.empty(n, n)
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


def check_variants(args: Any, settings: Sequence[str], backends: Sequence[str], options: Sequence[str] = ()) -> None:
    """``args.variants`` (``framework:setting``, lightalign's with optional ``+<sampler>`` and ``+<option>``
    suffixes) checked; None becomes every setting for both frameworks. Also refuses ``--warmup`` < 1 (the clock
    starts at the end of that step)."""
    if args.variants is None:
        args.variants = [f"{fw}:{s}" for s in settings for fw in FRAMEWORKS]
    for variant in args.variants:
        framework, _, setting = variant.partition(":")
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


def run_settings(args: Any) -> dict:
    """The settings ``add_run_arguments`` set, for ``print_settings`` (constant learning rate)."""
    return {"lr": f"{args.lr} constant", "max_grad_norm": args.max_grad_norm, "threads": args.threads,
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
    return f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl_version}"


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / name
    out.write_text(json.dumps(payload, indent=2))
    return out
