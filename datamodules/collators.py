"""Collators: tokenized rows -> batches (padded, or padding-free), and bin packing of rows.

Rows are dicts with ``input_ids`` and ``completion_mask`` (1 = the token is a loss target). Packed rows also
carry ``seq_lengths``: the lengths of the sequences concatenated in them.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

import torch

IGNORE_INDEX = -100


def _labels(input_ids: list[int], completion_mask: list[int] | None) -> list[int]:
    if completion_mask is None:
        return list(input_ids)
    return [tok if keep else IGNORE_INDEX for tok, keep in zip(input_ids, completion_mask)]


class PaddingCollator:
    """Pad to the longest row of the batch (right padding): ``input_ids``, ``attention_mask``, ``labels``."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            m = self.pad_to_multiple_of
            longest = (longest + m - 1) // m * m
        input_ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
        labels = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids[i, :n] = torch.tensor(row["input_ids"], dtype=torch.long)
            attention_mask[i, :n] = 1
            labels[i, :n] = torch.tensor(_labels(row["input_ids"], row.get("completion_mask")), dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class PaddingFreeCollator:
    """Concatenate every sequence of the batch into one row ``[1, total_tokens]``: no pad token is computed.

    ``position_ids`` restart at 0 for each sequence, and there is no ``attention_mask``: transformers then
    builds a block-diagonal causal mask from the position ids (and flash attention uses them as
    ``cu_seqlens``), so attention never crosses a sequence boundary. The first token of every sequence is not
    a target, exactly as in an unpacked batch. ``sequence_sizes`` lists the sequence lengths as host integers,
    so the per-sequence attention (``sdpa_varlen``) never reads them back from the device.
    """

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        sizes: list[int] = []
        for row in rows:
            row_labels = _labels(row["input_ids"], row.get("completion_mask"))
            start = 0
            for length in row.get("seq_lengths") or [len(row["input_ids"])]:
                seq = row["input_ids"][start : start + length]
                seq_labels = row_labels[start : start + length]
                ids.extend(seq)
                labels.append(IGNORE_INDEX)
                labels.extend(seq_labels[1:])
                positions.extend(range(length))
                sizes.append(length)
                start += length
        as_row = lambda xs: torch.tensor(xs, dtype=torch.long).unsqueeze(0)  # noqa: E731
        return {"input_ids": as_row(ids), "position_ids": as_row(positions), "labels": as_row(labels),
                "sequence_sizes": sizes}


def pack_best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing of sequence indices into bins of ``capacity`` tokens.

    Sequences are never split (each is at most ``capacity`` long after truncation). Returns bins of indices.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin id)
    for i in order:
        need = lengths[i]
        if need > capacity:
            raise ValueError(f"Sequence {i} has {need} tokens, more than the packing capacity {capacity}.")
        k = bisect.bisect_left(free, (need, -1))
        if k < len(free):
            remaining, b = free.pop(k)
        else:
            remaining, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        bisect.insort(free, (remaining - need, b))
    return bins
