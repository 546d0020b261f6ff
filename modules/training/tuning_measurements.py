"""First-use micro-measurements of device-tuned constants (``device_tuning``): each times the tuned behaviour
against the neutral one on this machine, at the sizes the table's value was chosen for, in well under a second on
an idle 2-core CPU, and says whether the tuned value wins here. Medians of alternating repeats (a busy machine
slows both sides alike); the verdict is cached under the machine key, so a machine pays once.

* ``prepack``: three of a decode step's linears of the small model (hidden 512, MLP 1920; 16 live rows) on
  oneDNN-prepacked weights against plain ``F.linear``, the reorder of the weights counted once per 256 decode steps
  (a rollout of the reasoning workload, where the table's 1.25x was measured).
* ``split_packed``: forward+backward attention over a packed row of 8 sequences of 140 tokens (4 heads of 64), one
  causal SDPA call per sequence (as ``varlen_sdpa_forward`` calls it) against one call with the row's block-causal
  mask.
* ``split_segments``: the same for shared-prefix rows of three 150-token segments (45,000 query-key scores saved per
  call, above ``min_saved_scores_per_call``'s break-even), per-segment calls against the one masked call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

ROWS, HIDDEN, MLP = 16, 512, 1920  # the small model's decode step (docs/performance.md 'Prepacked linears')
TOKENS = 16  # decode calls per timed sample
TOKENS_PER_REORDER = 256  # decode steps per reorder of the weights: a rollout of the reasoning workload


def tuned_wins(tuned: Callable[[], object], neutral: Callable[[], object], repeats: int = 7) -> tuple[bool, float, float]:
    """(whether ``tuned`` is faster, its median seconds, ``neutral``'s median): one warm-up each, then ``repeats``
    alternating pairs."""
    tuned(), neutral()
    times: dict[str, list[float]] = {"tuned": [], "neutral": []}
    for _ in range(repeats):
        for side, run in (("tuned", tuned), ("neutral", neutral)):
            start = time.perf_counter()
            run()
            times[side].append(time.perf_counter() - start)
    a, b = statistics.median(times["tuned"]), statistics.median(times["neutral"])
    return a < b, a, b


def prepack(table: dict) -> bool:
    """Whether oneDNN-prepacked linears (``packed_linears``' product, with the table's rows hint) beat plain ones."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    gen = torch.Generator().manual_seed(0)
    shapes = ((HIDDEN, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP))  # q, up, down
    weights = [torch.randn(out, inp, generator=gen) * 0.02 for out, inp in shapes]
    inputs = [torch.randn(ROWS, w.shape[1], generator=gen) for w in weights]
    hint = table["packed_linear_rows_hint"].value

    def reorder():
        return [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in weights]

    packs = reorder()

    def packed():
        with torch.no_grad():
            for p, x in zip(packs, inputs):
                for _ in range(TOKENS):
                    torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    def plain():
        with torch.no_grad():
            for w, x in zip(weights, inputs):
                for _ in range(TOKENS):
                    torch.nn.functional.linear(x, w)

    _, packed_s, plain_s = tuned_wins(packed, plain, repeats=5)
    reorder_s = statistics.median(_seconds(reorder) for _ in range(3))
    return packed_s + reorder_s * TOKENS / TOKENS_PER_REORDER < plain_s


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _attention_rows(sizes: list[int], heads: int = 4, dim: int = 64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, sum(sizes), dim, generator=gen).requires_grad_() for _ in range(3)]


def _block_causal(sizes: list[int]) -> torch.Tensor:
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return ((ids[:, None] == ids[None, :]) & torch.ones(len(ids), len(ids), dtype=torch.bool).tril())[None, None]


def _split_against_masked(sizes: list[int], causal_pieces: bool) -> bool:
    """Forward+backward of one packed row: one SDPA call per piece (``varlen_sdpa_forward``'s calls: the row split,
    each piece causal, or under its block of the mask) against one call with the row's block-causal mask."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = _attention_rows(sizes)
    mask = _block_causal(sizes)
    edges = [0, *torch.tensor(sizes).cumsum(0).tolist()]

    def pieces(q, k, v):
        parts = zip(*(t.split(sizes, dim=2) for t in (q, k, v)))
        if causal_pieces:
            return torch.cat([sdpa(a, b, c, is_causal=True) for a, b, c in parts], dim=2)
        return torch.cat([sdpa(a, b, c, attn_mask=mask[..., s:e, s:e])
                          for (a, b, c), s, e in zip(parts, edges[:-1], edges[1:])], dim=2)

    def step(attend):
        def run():
            attend(q, k, v).sum().backward()
            for t in (q, k, v):
                t.grad = None
        return run

    return tuned_wins(step(pieces), step(lambda q, k, v: sdpa(q, k, v, attn_mask=mask)), repeats=3)[0]


def split_packed(table: dict) -> bool:
    return _split_against_masked([140] * 8, causal_pieces=True)


def split_segments(table: dict) -> bool:
    return _split_against_masked([150] * 3, causal_pieces=False)


def bf16_attention(table: dict) -> bool:
    """Whether float32 attention beats bf16 attention on short rows (``bf16_attention_fp32_max_tokens``)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(8, 8, 128, 64, generator=gen).to(torch.bfloat16) for _ in range(3)]
    sides = {dtype: [v.to(dtype).requires_grad_() for v in values] for dtype in (torch.float32, torch.bfloat16)}

    def step(dtype):
        def run():
            q, k, v = sides[dtype]
            sdpa(q, k, v, is_causal=True).float().sum().backward()
            for t in (q, k, v):
                t.grad = None
        return run

    return tuned_wins(step(torch.float32), step(torch.bfloat16), repeats=3)[0]


# name -> measurement: called with ``device_tuning.TABLE``, returns whether the tuned value wins on this machine
MEASUREMENTS: dict[str, Callable[[dict], bool]] = {"prepack": prepack, "split_packed": split_packed,
                                                   "split_segments": split_segments, "bf16_attention": bf16_attention}
