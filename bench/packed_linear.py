"""Decode-sized linears: PyTorch's default CPU matmul against oneDNN on a prepacked weight (modules/sampling/packed_linear.py).

    .venv/bin/python bench/packed_linear.py [--threads 1 2] [--rows 1 2 4 8 16 32] [--repeats 30]

The `small` model's 24 MLP matrices (8 layers x gate/up [1920, 512] and down [512, 1920], 94 MB of float32: more
than the caches hold, as in a decode step) multiplied by `rows` rows, one matrix after the other; milliseconds per
pass over the 24 (median of --repeats passes after 3 untimed ones), `F.linear` against
`torch.ops.mkldnn._linear_pointwise` on the weights reordered once by `_reorder_linear_weight` (row hint 32, what
`packed_linears` uses), and the largest absolute difference of their outputs. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)")
    from lightalign.modules.sampling.packed_linear import ROWS_HINT, prepacked_linear

    torch.manual_seed(0)
    weights = [torch.randn(1920, 512) if i % 3 < 2 else torch.randn(512, 1920) for i in range(24)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT) for w in weights]
    print(f"torch {torch.__version__}; 24 matrices, {sum(w.numel() for w in weights) * 4 / 2**20:.0f} MiB float32\n")
    print("| threads | rows | F.linear ms | prepacked oneDNN ms | speed-up | max abs difference |")
    print("|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            xs = [torch.randn(rows, 1, w.shape[1]) for w in weights]
            plain = timed(lambda: [F.linear(x, w) for x, w in zip(xs, weights)], args.repeats)
            fast = timed(lambda: [prepacked_linear(x, p, None) for x, p in zip(xs, packed)], args.repeats)
            diff = max(float((prepacked_linear(x, p, None) - F.linear(x, w)).abs().max())
                       for x, w, p in zip(xs, weights, packed))
            print(f"| {threads} | {rows} | {plain:.2f} | {fast:.2f} | {plain / fast:.2f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
