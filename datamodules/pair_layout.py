"""The shared-prompt layout of preference pairs: the prompt is computed once for chosen and rejected.

A pair becomes one segment ``[prompt, chosen, rejected]`` whose position ids restart after the prompt
(``0..P-1, P..P+C-1, P..P+R-1``), so the rejected tokens sit exactly where they would in ``[prompt, rejected]``.
A 4D attention mask keeps attention causal, inside the segment, and keeps rejected tokens from seeing chosen
ones. Each token then sees exactly what it sees in the classic layout (``[prompt, chosen]`` and
``[prompt, rejected]`` as two padded rows), so the log-probs agree, while the prompt's tokens are computed once
instead of twice.

Segments are packed first-fit into rows of ``pack_length`` tokens (a longer pair gets a row of its own), so
padding is only the tail of each row. Attention cost per row is at most ``pack_length``² — the same order as one
padded sequence — which is why rows are bounded rather than the whole batch made one row.

Logits are needed only where a completion token is predicted: the last prompt token (it predicts the first
chosen token *and* the first rejected token), every chosen token but the last, every rejected token but the
last. ``logits_mask`` marks those positions; ``target_logit_index`` maps every completion token to its row in
the flattened ``logits[logits_mask]``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

PROMPT, CHOSEN, REJECTED, PAD = 0, 1, 2, -1


def pair_attention_mask(segment: torch.Tensor, role: torch.Tensor) -> torch.Tensor:
    """``[R, 1, T, T]`` boolean mask (True = may attend) from per-token segment ids and roles.

    Query ``q`` sees key ``k`` when ``k <= q``, both belong to one segment, and not (``q`` rejected and ``k``
    chosen). Padding is seen by nobody; a padding query sees itself only (a fully masked row would be NaN).
    """
    length = segment.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment.device).tril()
    same = segment[:, :, None] == segment[:, None, :]
    crossing = (role[:, :, None] == REJECTED) & (role[:, None, :] == CHOSEN)
    real_key = (role != PAD)[:, None, :]
    allowed = causal & same & ~crossing & real_key
    eye = torch.eye(length, dtype=torch.bool, device=segment.device)
    allowed |= eye & (role == PAD)[:, :, None]
    return allowed[:, None]


def pack_first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity`` (first fit, longest first)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max(capacity, lengths[i]) - lengths[i])
    return bins


class SharedPromptCollator:
    """Preference pairs -> the shared-prompt layout (see the module docstring).

    The batch holds ``input_ids``, ``position_ids`` and ``role`` (``[R, T]``; role 0 prompt, 1 chosen,
    2 rejected, -1 padding), ``attention_mask`` (``[R, 1, T, T]`` bool), ``logits_mask`` (``[R, T]`` bool),
    and one entry per completion token: ``targets`` (the token), ``target_logit_index`` (its row in
    ``logits[logits_mask]``), ``target_sequence`` (``i`` = chosen of pair ``i``, ``B + i`` = rejected of pair
    ``i``) and ``target_offset`` (position inside its completion). ``chosen_lengths`` / ``rejected_lengths``
    are per pair, and precomputed ``ref_chosen_logps`` / ``ref_rejected_logps`` pass through.

    Args:
        pad_token_id: the id written in padding positions (never attended, never scored).
        pack_length: row capacity in tokens; pairs longer than this get a row of their own.
    """

    def __init__(self, pad_token_id: int, pack_length: int = 512) -> None:
        if pack_length < 1:
            raise ValueError(f"pack_length must be >= 1, got {pack_length}.")
        self.pad_token_id, self.pack_length = pad_token_id, pack_length

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        n = len(rows)
        parts = [(list(r["prompt_input_ids"]), list(r["chosen_input_ids"]), list(r["rejected_input_ids"]))
                 for r in rows]
        for i, (prompt, chosen, rejected) in enumerate(parts):
            if not prompt or not chosen or not rejected:
                raise ValueError(f"pair {i} of the batch has an empty prompt, chosen or rejected part; the shared-"
                                 "prompt layout needs at least one token in each.")
        bins = pack_first_fit([sum(map(len, p)) for p in parts], self.pack_length)
        width = max(sum(sum(map(len, parts[i])) for i in b) for b in bins)
        shape = (len(bins), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        segment = torch.full(shape, -1, dtype=torch.long)
        role = torch.full(shape, PAD, dtype=torch.long)
        logits_mask = torch.zeros(shape, dtype=torch.bool)
        # (row, column predicting it, token, sequence, offset) for every completion token
        scored: list[tuple[int, int, int, int, int]] = []
        for r, members in enumerate(bins):
            start = 0
            for i in members:
                prompt, chosen, rejected = parts[i]
                p, c = len(prompt), len(chosen)
                tokens = prompt + chosen + rejected
                span = slice(start, start + len(tokens))
                input_ids[r, span] = torch.tensor(tokens)
                position_ids[r, span] = torch.tensor(
                    list(range(p)) + list(range(p, p + c)) + list(range(p, p + len(rejected))))
                segment[r, span] = i
                role[r, span] = torch.tensor([PROMPT] * p + [CHOSEN] * c + [REJECTED] * len(rejected))
                last_prompt = start + p - 1
                for sequence, first, completion in ((i, start + p, chosen), (n + i, start + p + c, rejected)):
                    for k, token in enumerate(completion):
                        scored.append((r, last_prompt if k == 0 else first + k - 1, token, sequence, k))
                start += len(tokens)
        for r, col, *_ in scored:
            logits_mask[r, col] = True
        # rows of logits[logits_mask] are in row-major order of the kept positions
        flat = torch.full(shape, -1, dtype=torch.long)
        flat[logits_mask] = torch.arange(int(logits_mask.sum()))
        batch = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "role": role,
            "attention_mask": pair_attention_mask(segment, role),
            "logits_mask": logits_mask,
            "targets": torch.tensor([s[2] for s in scored], dtype=torch.long),
            "target_logit_index": torch.tensor([int(flat[s[0], s[1]]) for s in scored], dtype=torch.long),
            "target_sequence": torch.tensor([s[3] for s in scored], dtype=torch.long),
            "target_offset": torch.tensor([s[4] for s in scored], dtype=torch.long),
            "chosen_lengths": torch.tensor([len(p[1]) for p in parts], dtype=torch.long),
            "rejected_lengths": torch.tensor([len(p[2]) for p in parts], dtype=torch.long),
        }
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in rows[0]:
                batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
        return batch
