"""Per-sequence SDPA for padding-free rows: ``attn_implementation="sdpa_varlen"``.

A padding-free batch is one row holding several sequences, their ``position_ids`` restarting at each. With plain
``sdpa``, transformers turns that into one ``[T, T]`` block-diagonal mask and the kernel computes every query
against every key of the row, then masks: attention costs ``T**2`` instead of ``sum(L_i**2)`` (about 30% of an SFT
step on CPU at 8 sequences of ~140 tokens). Flash-attention's varlen kernels avoid this on GPUs; ``sdpa_varlen`` does
the same with stock SDPA by attending each sequence on its own with ``is_causal=True``.

The sequences are given by ``cu_seq_lens_q``/``cu_seq_lens_k`` (cumulative lengths, the flash-attention kwargs
that transformers passes to every attention layer). The shared-prefix layouts (DPO pairs, GRPO groups; see
``datamodules/shared_prefix.py``) pack several segments per row under a custom 4D mask; given ``segment_bounds``
(per row, the segment edges) each segment attends on its own with its slice of that mask, ``sum(S_i**2)`` instead
of ``T**2`` per row, when that saves enough work to pay for the extra kernel calls (``worth_splitting``). Every
other call — padded batches, generation with a KV cache, sliding windows,
``torch.compile`` tracing — goes to transformers' own ``sdpa`` function unchanged, with the mask transformers
built for ``sdpa``. The name is not saved
in ``config.json`` (transformers drops the runtime attention setting), so exported models load anywhere.
"""

from __future__ import annotations

import torch

VARLEN_SDPA = "sdpa_varlen"

# Splitting a shared-prefix row into one SDPA call per segment pays only when each extra call saves enough
# query-key scores: on this project's 2-core CPU, short chat pairs (~26-token segments, ~5k scores saved per call)
# ran forward+backward 7% faster with the row's one masked call, long-tailed pairs (~150-token segments, 42k-62k
# saved per call) 7% faster split. The break-even lies near 30k; this is the threshold.
MIN_SAVED_SCORES_PER_CALL = 32768


def worth_splitting(segments: list[list[int]], width: int) -> bool:
    """Whether per-segment attention (``segment_bounds``) beats one masked call over rows of ``width`` tokens:
    the query-key scores it saves (``width**2 - sum(S_i**2)`` per row) per SDPA call it runs, against
    ``MIN_SAVED_SCORES_PER_CALL``."""
    calls = sum(len(edges) - 1 for edges in segments)
    if calls == 0:
        return False
    saved = sum(width * width - sum((e - s) ** 2 for s, e in zip(edges[:-1], edges[1:])) for edges in segments)
    return saved >= MIN_SAVED_SCORES_PER_CALL * calls


def sequence_boundaries(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence lengths ``[0, L_1, L_1+L_2, …, T]`` (int32) of a one-row padding-free batch: a sequence
    starts wherever the position does not follow the previous one (transformers' own packed-sequence rule)."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"sequence_boundaries takes one packed row [1, T], got shape {tuple(position_ids.shape)}.")
    row = position_ids[0]
    starts = torch.nonzero(row[1:] - row[:-1] != 1).flatten() + 1
    edges = [row.new_zeros(1), starts, row.new_full((1,), row.shape[0])]
    return torch.cat(edges).to(torch.int32)


def varlen_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        is_causal=None, **kwargs):
    """transformers attention function (``[B, H, T, D]`` in, ``[B, T, H, D]`` out): one causal SDPA per sequence of
    ``cu_seq_lens_q`` when the call is a packed self-attention over one row; otherwise transformers' ``sdpa``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.pop("cu_seq_lens_q", None)
    bounds_k = kwargs.pop("cu_seq_lens_k", None)
    segments = kwargs.pop("segment_bounds", None)
    self_attention = (
        query.shape[2] == key.shape[2]  # no KV cache: keys are the rows themselves
        and kwargs.get("sliding_window") is None
        and getattr(module, "is_causal", True)
        and not torch.compiler.is_compiling()
    )
    if (self_attention and segments is not None and attention_mask is not None and attention_mask.dim() == 4
            and attention_mask.dtype == torch.bool and len(segments) == query.shape[0]):
        return _per_segment(module, query, key, value, attention_mask, segments, dropout, scaling, kwargs), None
    if (self_attention and bounds is not None and query.shape[0] == 1 and is_causal is not False
            and (bounds_k is None or bounds_k is bounds or torch.equal(bounds_k, bounds))):
        edges = bounds.tolist()
        sizes = [e - s for s, e in zip(edges[:-1], edges[1:])]
        outputs = [
            sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True,
                                   **kwargs)[0]
            for q, k, v in zip(*(t.split(sizes, dim=2) for t in (query, key, value)))  # split: cheap backward
        ]
        return torch.cat(outputs, dim=1), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _per_segment(module, query, key, value, mask, segments, dropout, scaling, kwargs) -> torch.Tensor:
    """Rows of segments under a boolean 4D mask that never crosses a segment edge: each segment attends with its
    own block of the mask. Positions past a row's last edge (padding) get zeros."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = []
    # split (not slicing): its backward is one concatenation, where each slice's backward fills a whole zero tensor
    for r, (q_row, k_row, v_row) in enumerate(zip(*(t.split(1, dim=0) for t in (query, key, value)))):
        edges = segments[r]
        sizes = [e - s for s, e in zip(edges[:-1], edges[1:])]
        tail = query.shape[2] - edges[-1]
        pieces = zip(*(t.split(sizes + [tail], dim=2) for t in (q_row, k_row, v_row)))
        parts = [
            sdpa_attention_forward(module, q, k, v, mask[r:r + 1, :, s:e, s:e], dropout=dropout, scaling=scaling,
                                   is_causal=False, **kwargs)[0]
            for (q, k, v), s, e in zip(pieces, edges[:-1], edges[1:])
        ]
        if tail:
            parts.append(query.new_zeros(1, tail, query.shape[1], query.shape[3]))
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0)


def register_varlen_sdpa() -> None:
    """Make ``sdpa_varlen`` a transformers attention implementation (its masks are those of ``sdpa``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_forward)
    AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)


def use_varlen_sdpa(model: torch.nn.Module) -> bool:
    """Switch a model that runs ``sdpa`` to ``sdpa_varlen`` (same results, per-sequence attention on packed rows).
    Models on another implementation (eager, flash attention, a hub kernel) are left as they are. Returns whether
    the model now runs ``sdpa_varlen``."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", VARLEN_SDPA):
        return False
    register_varlen_sdpa()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "set_attn_implementation"):
        base.set_attn_implementation(VARLEN_SDPA)
    return getattr(base.config, "_attn_implementation", None) == VARLEN_SDPA
