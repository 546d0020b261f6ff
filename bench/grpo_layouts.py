"""GRPO's training half in its three layouts: forward + backward seconds and memory of one micro-batch.

    python bench/grpo_layouts.py [--model assets/models/small] [--completions 16] [--repeat 5] [--threads 2]

The micro-batch looks like a reasoning workload's: ``--completions`` completions of ``--group`` per prompt, prompts of
about 20 tokens, completion lengths spread evenly between ``--min-len`` and ``--max-len`` (shuffled). Each layout
computes the per-token log-probs (``rollout_forward.grpo_forward``), the dapo loss and its backward:

* ``padded``: ``[left-padded prompt, completion padded to the longest]`` rows;
* ``shared``: ``prompt_sharing`` (one segment per prompt, a branch mask; ``pack_length`` 1024);
* ``packed``: ``padding_free`` (one row, no padding, one attention call per sequence).

Timings alternate the layouts inside one process (the order reversed on every other repeat) and are medians.
Memory: the bytes autograd saves for the backward (activations, counted once per storage) in this process, and
with ``--rss`` the peak RSS of a fresh process per layout (``harness.spawn``). Building the layout's batch (a
rollout-time cost) is timed apart. The figures are this machine's: say how busy it was when quoting them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, emit, peak_rss_mb, spawn  # noqa: E402

LAYOUTS = ("padded", "shared", "packed")


def micro_batch(args) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed)
    n, group = args.completions, args.group
    prompts = [torch.randint(3, 1000, (int(torch.randint(args.prompt_len - 4, args.prompt_len + 5, (), generator=g)),),
                             generator=g) for _ in range(n // group)]
    lengths = torch.linspace(args.min_len, args.max_len, n).round().long()[torch.randperm(n, generator=g)]
    width_p, width_c = max(len(p) for p in prompts), int(lengths.max())
    mb = {"prompt_ids": torch.zeros(n, width_p, dtype=torch.long),
          "prompt_mask": torch.zeros(n, width_p, dtype=torch.long),
          "completion_ids": torch.zeros(n, width_c, dtype=torch.long),
          "completion_mask": (torch.arange(width_c)[None] < lengths[:, None]).long()}
    for row in range(n):
        p = prompts[row // group]
        mb["prompt_ids"][row, width_p - len(p):], mb["prompt_mask"][row, width_p - len(p):] = p, 1
        mb["completion_ids"][row, : lengths[row]] = torch.randint(3, 1000, (int(lengths[row]),), generator=g)
    mb["advantages"] = torch.randn(n, generator=g)
    return mb


def with_layout(mb: dict, layout: str) -> tuple[dict, float]:
    from lightalign.modules.adaptations.layouts import packed_completion_batch, prompt_group_batch

    start = time.perf_counter()
    out = dict(mb)
    if layout == "shared":
        out["shared"] = prompt_group_batch(mb, 0, 1024)
    elif layout == "packed":
        out["packed"] = packed_completion_batch(mb)
    return out, time.perf_counter() - start


def tokens_computed(mb: dict) -> int:
    if "packed" in mb:
        return mb["packed"]["input_ids"].numel()
    if "shared" in mb:
        return mb["shared"]["input_ids"].numel()
    return mb["prompt_ids"].numel() + mb["completion_ids"].numel()


def step(model, mb: dict) -> tuple[float, int]:
    """Forward + dapo loss + backward: seconds and the bytes autograd saved for the backward."""
    from lightalign.modules.losses.grpo import grpo_loss
    from lightalign.modules.training.rollout_forward import grpo_forward

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logps, _, _ = grpo_forward(model, mb)
        loss, _ = grpo_loss(logps, None, mb["advantages"], mb["completion_mask"], loss_type="dapo")
    loss.backward()
    return time.perf_counter() - start, sum(seen.values())


def load(args):
    from lightalign.hub import load_causal_lm
    from lightalign.modules.adaptations import adapt_model

    torch.manual_seed(args.seed)
    model = load_causal_lm(args.model, from_config=True)
    adapt_model(model)  # sdpa_varlen, MLP recompute: as GRPOModule trains
    return model.train()


def one(args) -> None:
    """Child of --rss: one layout, a warm-up and one timed step, then the peak RSS."""
    model = load(args)
    mb, _ = with_layout(micro_batch(args), args.layout)
    step(model, mb)
    seconds, saved = step(model, mb)
    emit({"layout": args.layout, "seconds": seconds, "saved_mb": saved / 2**20, "peak_rss_mb": peak_rss_mb()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "assets" / "models" / "small"))
    parser.add_argument("--completions", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=20)
    parser.add_argument("--min-len", type=int, default=20)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss", action="store_true", help="also the peak RSS of one fresh process per layout")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=LAYOUTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        return one(args)
    model = load(args)
    base = micro_batch(args)
    batches, build = {}, {}
    for layout in LAYOUTS:
        batches[layout], build[layout] = with_layout(base, layout)
    times: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    saved: dict[str, int] = {}
    for layout in LAYOUTS:  # warm-up
        step(model, batches[layout])
    for r in range(args.repeat):
        for layout in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]):
            seconds, saved[layout] = step(model, batches[layout])
            times[layout].append(seconds)
    lengths = base["completion_mask"].sum(-1)
    print(f"model {args.model}, {args.completions} completions ({args.group} per prompt), prompts ~{args.prompt_len}, "
          f"completions {int(lengths.min())}-{int(lengths.max())} (mean {lengths.float().mean():.0f}), "
          f"{args.threads} threads, {args.repeat} alternated repeats")
    padded = statistics.median(times["padded"])
    for layout in LAYOUTS:
        med = statistics.median(times[layout])
        print(f"{layout:>7}: fwd+bwd {med:.3f} s (x{padded / med:.2f} vs padded; min {min(times[layout]):.3f}), "
              f"tokens computed {tokens_computed(batches[layout])}, saved for backward {saved[layout] / 2**20:.0f} MB, "
              f"layout built in {build[layout] * 1e3:.1f} ms")
    if args.rss:
        argv = ["--model", args.model, "--completions", args.completions, "--group", args.group, "--prompt-len",
                args.prompt_len, "--min-len", args.min_len, "--max-len", args.max_len, "--seed", args.seed,
                "--threads", args.threads]
        for layout in LAYOUTS:
            result = spawn(__file__, [*argv, "--layout", layout], args.threads, layout)
            if result:
                print(f"{layout:>7}: peak RSS {result['peak_rss_mb']:.0f} MB (fresh process, one warm-up + one step)")


if __name__ == "__main__":
    main()
