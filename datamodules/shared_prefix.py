"""Shared-prefix layout: several continuations of one prompt computed with the prompt's tokens only once.

A *segment* is ``[prompt, branch_1, branch_2, ...]``: the DPO pair ``[prompt, chosen, rejected]``, or a GRPO
group ``[prompt, completion_1, ..., completion_G]``. Every branch's position ids restart after the prompt
(``P, P+1, ...``), so each branch sits exactly where it would in its own ``[prompt, branch]`` sequence. A 4D
attention mask keeps attention causal, inside the segment, and lets a branch see the prompt and itself only.
Each token thus sees exactly what it sees in the one-sequence-per-branch layout, so log-probs agree, while the
prompt is computed once instead of once per branch.

A batch of ``T`` tokens is split into ``ceil(T / pack_length)`` rows of balanced length (``pack_rows``), so
padding is only the short tail of each row, and the ``[T_row, T_row]`` mask of a row stays about
``pack_length``² however large the batch. ``pack_length=None`` puts every segment of the batch in one row: no
padding at all, but a mask that grows with the square of the batch.

A branch's last token is only ever a target: nothing after it in its branch attends to it and its own output
predicts nothing. It is therefore left out of the rows (a branch of n tokens occupies n - 1 positions), which
changes no log-prob and saves two positions per DPO pair (7% of the tokens of the shipped chat pairs).

Logits are needed only where a branch token is predicted: at the last prompt token (it predicts every
branch's first token) and at every branch position. ``logits_mask`` marks those positions;
``target_logit_index`` maps every branch token to its row in the flattened ``logits[logits_mask]``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

PROMPT, PAD = 0, -1
CHOSEN, REJECTED = 1, 2  # the branch numbers of a DPO pair

# (prompt tokens, [(sequence id, branch tokens), ...]): one segment
Segment = tuple[Sequence[int], Sequence[tuple[int, Sequence[int]]]]


def branch_attention_mask(segment: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """``[R, 1, T, T]`` boolean mask (True = may attend) from per-token segment ids and branch numbers.

    Query ``q`` sees key ``k`` when ``k <= q``, both belong to one segment, and ``k`` is a prompt token or in
    ``q``'s own branch. Padding is seen by nobody; a padding query sees itself only (a fully masked row would
    give NaN).
    """
    length = segment.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment.device).tril()
    same_segment = segment[:, :, None] == segment[:, None, :]
    visible_branch = (branch[:, None, :] == PROMPT) | (branch[:, :, None] == branch[:, None, :])
    real_key = (branch != PAD)[:, None, :]
    allowed = causal & same_segment & visible_branch & real_key
    eye = torch.eye(length, dtype=torch.bool, device=segment.device)
    allowed |= eye & (branch == PAD)[:, :, None]
    return allowed[:, None]


def check_pack_length(pack_length: int | None) -> None:
    if pack_length is not None and pack_length < 1:
        raise ValueError(f"pack_length must be >= 1 or None (one row per batch), got {pack_length}.")


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into ``ceil(sum / capacity)`` rows (at most one per length) of balanced
    size: longest first, each into the shortest row so far. A row then holds about ``sum / rows`` tokens, at
    most that plus the longest length, so padding the rows to the widest one wastes little."""
    rows = min(len(lengths), max(1, -(-sum(lengths) // capacity)))
    bins: list[list[int]] = [[] for _ in range(rows)]
    load = [0] * rows
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        b = min(range(rows), key=load.__getitem__)
        bins[b].append(i)
        load[b] += lengths[i]
    return bins


def shared_prefix_batch(segments: Sequence[Segment], pad_token_id: int,
                        pack_length: int | None) -> dict[str, torch.Tensor]:
    """Segments -> the tensors of one forward in the shared-prefix layout.

    ``input_ids``, ``position_ids``, ``branch`` (``[R, T]``: 0 prompt, ``1..`` branch number inside its
    segment, -1 padding; every branch token but the branch's last is a position), ``attention_mask``
    (``[R, 1, T, T]`` bool), ``logits_mask`` (``[R, T]`` bool), and per
    branch token: ``targets``, ``target_logit_index`` (row of ``logits[logits_mask]`` predicting it),
    ``target_sequence`` (the branch's sequence id) and ``target_offset`` (position inside the branch).
    """
    check_pack_length(pack_length)
    for i, (prompt, branches) in enumerate(segments):
        if not prompt or not branches or any(len(tokens) == 0 for _, tokens in branches):
            raise ValueError(f"segment {i} has an empty prompt or branch; the shared-prefix layout needs at least "
                             "one token in each.")
    sizes = [len(prompt) + sum(len(tokens) - 1 for _, tokens in branches) for prompt, branches in segments]
    bins = pack_rows(sizes, sum(sizes) if pack_length is None else pack_length)
    shape = (len(bins), max(sum(sizes[i] for i in b) for b in bins))
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    segment_ids = torch.full(shape, -1, dtype=torch.long)
    branch_ids = torch.full(shape, PAD, dtype=torch.long)
    logits_mask = torch.zeros(shape, dtype=torch.bool)
    scored: list[tuple[int, int, int, int, int]] = []  # (row, column predicting it, token, sequence, offset)
    for r, members in enumerate(bins):
        start = 0
        for i in members:
            prompt, branches = segments[i]
            p = len(prompt)
            tokens, positions, numbers = list(prompt), list(range(p)), [PROMPT] * p
            last_prompt = start + p - 1
            for number, (sequence, branch) in enumerate(branches, start=1):
                first = start + len(tokens)
                for k, token in enumerate(branch):
                    scored.append((r, last_prompt if k == 0 else first + k - 1, token, sequence, k))
                inputs = list(branch[:-1])  # the last token is a target only (module docstring)
                tokens += inputs
                positions += range(p, p + len(inputs))
                numbers += [number] * len(inputs)
            span = slice(start, start + len(tokens))
            input_ids[r, span] = torch.tensor(tokens)
            position_ids[r, span] = torch.tensor(positions)
            segment_ids[r, span] = i
            branch_ids[r, span] = torch.tensor(numbers)
            start += len(tokens)
    rows, cols = zip(*[(s[0], s[1]) for s in scored])
    logits_mask[list(rows), list(cols)] = True
    flat = torch.full(shape, -1, dtype=torch.long)  # logits[logits_mask] is in row-major order
    flat[logits_mask] = torch.arange(int(logits_mask.sum()))
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "branch": branch_ids,
        "attention_mask": branch_attention_mask(segment_ids, branch_ids),
        "logits_mask": logits_mask,
        "targets": torch.tensor([s[2] for s in scored], dtype=torch.long),
        "target_logit_index": flat[list(rows), list(cols)],
        "target_sequence": torch.tensor([s[3] for s in scored], dtype=torch.long),
        "target_offset": torch.tensor([s[4] for s in scored], dtype=torch.long),
    }


def prompt_group_segments(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                          completion_lengths: torch.Tensor) -> list[Segment]:
    """Rows ``[prompt (padded), completion]`` -> one segment per distinct prompt with its rows' completions as
    branches (GRPO: a group's ``num_generations`` completions share one prompt). Sequence id = row index; each
    completion keeps its first ``completion_lengths[row]`` tokens (through EOS)."""
    groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
    lengths = completion_lengths.tolist()
    for row in range(prompt_ids.shape[0]):
        prompt = tuple(prompt_ids[row][prompt_mask[row].bool()].tolist())
        groups.setdefault(prompt, []).append((row, completion_ids[row, : lengths[row]].tolist()))
    return [(list(prompt), branches) for prompt, branches in groups.items()]


class SharedPromptCollator:
    """Preference pairs -> the shared-prefix layout: one ``[prompt, chosen, rejected]`` segment per pair.

    Sequence ids: ``i`` is the chosen completion of pair ``i``, ``B + i`` its rejected one. Besides the tensors
    of ``shared_prefix_batch``, the batch has ``chosen_lengths`` / ``rejected_lengths`` per pair and passes
    precomputed ``ref_chosen_logps`` / ``ref_rejected_logps`` through.

    Args:
        pad_token_id: the id written in padding positions (never attended, never scored).
        pack_length: about this many tokens per row (``pack_rows``); ``None``: all pairs of the batch in one
            row, without padding.
    """

    def __init__(self, pad_token_id: int, pack_length: int | None = 2048) -> None:
        check_pack_length(pack_length)
        self.pad_token_id, self.pack_length = pad_token_id, pack_length

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        n = len(rows)
        segments = [(r["prompt_input_ids"], [(i, r["chosen_input_ids"]), (n + i, r["rejected_input_ids"])])
                    for i, r in enumerate(rows)]
        batch = shared_prefix_batch(segments, self.pad_token_id, self.pack_length)
        batch["chosen_lengths"] = torch.tensor([len(r["chosen_input_ids"]) for r in rows], dtype=torch.long)
        batch["rejected_lengths"] = torch.tensor([len(r["rejected_input_ids"]) for r in rows], dtype=torch.long)
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in rows[0]:
                batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
        return batch
