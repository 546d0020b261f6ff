"""Per-sequence SDPA for padding-free rows: ``attn_implementation="sdpa_varlen"``.

A padding-free batch is one row holding several sequences, their ``position_ids`` restarting at each. With plain
``sdpa``, transformers turns that into one ``[T, T]`` block-diagonal mask and the kernel computes every query
against every key of the row, then masks: attention costs ``T**2`` instead of ``sum(L_i**2)`` (a large share of an SFT
step on CPU: measured, see docs/performance.md 'sdpa_varlen'). Flash-attention's varlen kernels avoid this on GPUs;
``sdpa_varlen`` does the same with stock SDPA by attending each sequence on its own with ``is_causal=True``.

The sequences are given by ``sequence_sizes`` (host integers, read from the batch once, not once per layer). The
shared-prefix layouts (DPO pairs, GRPO groups; see ``shared_prefix_batch``) pack several segments per
row under a custom 4D mask; given ``segment_bounds`` (per row, the segment edges) each segment attends on its own
with its block of that mask, ``sum(S_i**2)`` instead of ``T**2`` per row, when that saves enough work to pay for
the extra kernel calls (``worth_splitting``: a threshold measured on CPU and used on CPU only,
``tuned``'s ``min_saved_scores_per_call``).

Sliding windows are kept on every path: a packed sequence attends with a banded causal mask, and a custom 4D
mask gets the layer's window put back (``window_positions``), since it replaces the model's own sliding-window
mask. Every other call (padded batches, generation with a KV cache, ``torch.compile`` tracing) goes to
transformers' own ``sdpa`` function unchanged. The name is not saved in ``config.json`` (transformers drops the
runtime attention setting), so exported models load anywhere. Which models may use which layout is decided by
``check_layout``.

Registration is process-wide: transformers 5.24 looks attention functions up by the config's name in one registry
shared by every model (``AttentionInterface`` and ``AttentionMaskInterface`` are ``GeneralInterface`` mappings;
the modeling files all read the module-level ``ALL_ATTENTION_FUNCTIONS`` instance, and the mask code checks the
class-wide mapping itself), so a model cannot carry a mapping of its own. The name ``sdpa_varlen`` is therefore
registered once, lazily: the first time a model is switched to it (``use_varlen_sdpa``), never on import; again
it is a no-op, and a different function already registered under the name is refused rather than replaced. The
entry changes no other model (a model runs it only when its config names it) and stays for the process: a model
left on ``sdpa_varlen`` (the module's own) must keep finding it. A model passed in by the user is switched back to
its own implementation at teardown (``PolicyModule.undo_side_effects``).
"""

from __future__ import annotations

import functools

import torch

from lightalign.modules.training.device_tuning import TABLE
from lightalign.modules.training.device_tuning import mode as tuning_mode
from lightalign.modules.training.device_tuning import tuned

VARLEN_SDPA = "sdpa_varlen"


def worth_splitting(segments: list[list[int]], width: int, device: str | torch.device) -> bool:
    """Whether per-segment attention (``segment_bounds``) beats one masked call over rows of ``width`` tokens on
    ``device``: the query-key scores it saves (``width**2 - sum(S_i**2)`` per row) per SDPA call it runs, against
    the ``min_saved_scores_per_call`` measured on CPU (``tuned``'s table; short chat pairs run faster with the
    row's one masked call, long-tailed pairs faster split: docs/performance.md 'sdpa_varlen'). Never on other
    device types, where nothing was measured."""
    threshold = tuned("min_saved_scores_per_call", device)
    calls = sum(len(edges) - 1 for edges in segments)
    if threshold is None or calls == 0:
        return False
    saved = sum(width * width - sum((e - s) ** 2 for s, e in zip(edges[:-1], edges[1:])) for edges in segments)
    return saved >= threshold * calls


def sequence_sizes(position_ids: torch.Tensor) -> list[int]:
    """The lengths of the sequences of a one-row padding-free batch, as host integers (read once per batch, not
    once per layer): a sequence starts wherever the position does not follow the previous one (transformers' own
    packed-sequence rule)."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"sequence_sizes takes one packed row [1, T], got shape {tuple(position_ids.shape)}.")
    row = position_ids[0].tolist()
    starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1] + 1] + [len(row)]
    return [e - s for s, e in zip(starts[:-1], starts[1:])]


def windowed_mask(mask: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """A 4D mask (bool: True = may attend; or additive float) restricted to keys less than ``window`` positions
    behind the query, positions taken from ``position_ids`` ``[R, T]`` (a shared-prefix row's branches restart
    after their prompt, so a key's distance is that of the branch's own sequence). transformers' sliding-window
    rule: key ``k`` is seen from query ``q`` when ``q - window < k``."""
    near = (positions[:, None, :, None] - positions[:, None, None, :]) < window
    if mask.dtype == torch.bool:
        return mask & near
    return mask.masked_fill(~near, torch.finfo(mask.dtype).min)


def _band(length: int, window: int | None, device) -> torch.Tensor | None:
    """``[1, 1, L, L]`` causal mask limited to the last ``window`` keys (None when there is no window)."""
    if window is None or window >= length:
        return None
    rows = torch.arange(length, device=device)
    diff = rows[:, None] - rows[None, :]
    return ((diff >= 0) & (diff < window))[None, None]


def varlen_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        is_causal=None, **kwargs):
    """transformers attention function (``[B, H, T, D]`` in, ``[B, T, H, D]`` out).

    * ``sequence_sizes`` (host list, one packed row): one causal SDPA per sequence, limited to the layer's
      ``sliding_window`` when it has one;
    * ``segment_bounds`` (host lists, shared-prefix rows under a boolean 4D mask): one SDPA per segment with its
      block of the mask;
    * ``window_positions`` (the rows' ``position_ids``): the layer's ``sliding_window`` is put into a custom 4D
      mask (which replaced the model's own sliding-window mask);
    * anything else (padded batches, generation with a KV cache, ``torch.compile`` tracing): transformers' own
      ``sdpa`` with the mask transformers built for ``sdpa``.
    """
    for unused in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(unused, None)
    sizes = kwargs.pop("sequence_sizes", None)
    segments = kwargs.pop("segment_bounds", None)
    positions = kwargs.pop("window_positions", None)
    window = kwargs.get("sliding_window")
    if window is not None and positions is not None and attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = windowed_mask(attention_mask, positions, int(window))
    self_attention = (
        query.shape[2] == key.shape[2]  # no KV cache: keys are the rows themselves
        and getattr(module, "is_causal", True)
        and not torch.compiler.is_compiling()
    )
    if (self_attention and segments is not None and attention_mask is not None and attention_mask.dim() == 4
            and attention_mask.dtype == torch.bool and len(segments) == query.shape[0]):
        return _per_segment(module, query, key, value, attention_mask, segments, dropout, scaling, kwargs), None
    if self_attention and sizes is not None and query.shape[0] == 1 and is_causal is not False:
        outputs = []
        for q, k, v in zip(*(t.split(list(sizes), dim=2) for t in (query, key, value))):  # split: cheap backward
            band = _band(q.shape[2], None if window is None else int(window), q.device)
            outputs.append(_attend(module, q, k, v, band, dropout=dropout, scaling=scaling,
                                   is_causal=band is None, **kwargs)[0])
        return torch.cat(outputs, dim=1), None
    return _attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                   **kwargs)


FP32_ATTENTION = "bf16_attention_fp32_max_tokens"


@functools.lru_cache(maxsize=8)
def _fp32_attention_limit(tuning_mode: str, threads: int, entry) -> int | None:
    """``bf16_attention_fp32_max_tokens`` on this CPU, resolved once per tuning mode, thread count (the machine key's
    part that changes within a process) and table entry: ``tuned`` reads the machine's verdicts, too slow for every
    attention call."""
    return tuned(FP32_ATTENTION, "cpu")


def _attend(module, query, key, value, mask, **kwargs):
    """transformers' ``sdpa`` attention; under the CPU's bf16 autocast, computed in float32 (autocast off, the
    inputs upcast exactly, a floating mask too) for rows of at most ``bf16_attention_fp32_max_tokens`` keys: torch's
    bf16 attention backward on the CPU is slower than float32's there (device tuning, measured on this machine),
    and float32 is the more precise of the two."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (query.device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16):
        limit = _fp32_attention_limit(tuning_mode(), torch.get_num_threads(), TABLE[FP32_ATTENTION])
        if limit is not None and key.shape[2] <= limit:
            if mask is not None and mask.is_floating_point():
                mask = mask.float()
            with torch.autocast("cpu", enabled=False):
                return sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def _per_segment(module, query, key, value, mask, segments, dropout, scaling, kwargs) -> torch.Tensor:
    """Rows of segments under a boolean 4D mask that never crosses a segment edge: each segment attends with its
    own block of the mask. Positions past a row's last edge (padding) get zeros."""
    rows = []
    # split (not slicing): its backward is one concatenation, where each slice's backward fills a whole zero tensor
    for r, (q_row, k_row, v_row) in enumerate(zip(*(t.split(1, dim=0) for t in (query, key, value)))):
        edges = segments[r]
        sizes = [e - s for s, e in zip(edges[:-1], edges[1:])]
        tail = query.shape[2] - edges[-1]
        pieces = zip(*(t.split(sizes + [tail], dim=2) for t in (q_row, k_row, v_row)))
        parts = [
            _attend(module, q, k, v, mask[r:r + 1, :, s:e, s:e], dropout=dropout, scaling=scaling, is_causal=False,
                    **kwargs)[0]
            for (q, k, v), s, e in zip(pieces, edges[:-1], edges[1:])
        ]
        if tail:
            parts.append(query.new_zeros(1, tail, query.shape[1], query.shape[3]))
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0)


def register_varlen_sdpa() -> None:
    """Make ``sdpa_varlen`` a transformers attention implementation (its masks are those of ``sdpa``), once per
    process: process-wide, as transformers' registry is (see the module docstring); a no-op when registered, and
    an error when another function holds the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for interface, function in ((AttentionInterface, varlen_sdpa_forward), (AttentionMaskInterface, sdpa_mask)):
        held = interface._global_mapping.get(VARLEN_SDPA)
        if held is None:
            interface.register(VARLEN_SDPA, function)
        elif held is not function and _qualified(held) != _qualified(function):  # (a reloaded module: the same)
            raise RuntimeError(f"transformers' {interface.__name__} already holds another function under "
                               f"{VARLEN_SDPA!r} ({_qualified(held)}); lightalign registers its per-sequence SDPA "
                               "under that name and will not replace it.")


def _qualified(function) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def use_varlen_sdpa(model: torch.nn.Module) -> bool:
    """Switch a model that runs ``sdpa`` to ``sdpa_varlen`` (same results, per-sequence attention on packed rows).
    Models on another implementation (eager, flash attention, a hub kernel) are left as they are. Returns whether
    the model now runs ``sdpa_varlen``."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", VARLEN_SDPA):
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(type(base), "_supports_attention_backend", False):
        return False  # its attention code does not call transformers' attention functions (Falcon, Bloom ...)
    register_varlen_sdpa()
    if hasattr(base, "set_attn_implementation"):
        base.set_attn_implementation(VARLEN_SDPA)
    return getattr(base.config, "_attn_implementation", None) == VARLEN_SDPA
