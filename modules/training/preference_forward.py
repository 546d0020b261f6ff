"""The pair-batch layouts of ``PreferenceDataModule`` seen from the model (shared-prompt, classic padded, classic
padding-free): how many pairs a batch holds, its
completion lengths, and the per-token completion log-probs of one forward (``DPOModule`` reads them)."""

from __future__ import annotations

import torch

from lightalign.modules.training.logprobs import (
    completion_logps,
    log_sum_squared_probs,
    scatter_to_sequences,
    selective_log_softmax,
    shared_prefix_logits,
)
from lightalign.modules.training.sft_forward import sft_logits


def shared_prompt_layout(batch: dict[str, torch.Tensor]) -> bool:
    return "target_logit_index" in batch


def padding_free_layout(batch: dict[str, torch.Tensor]) -> bool:
    return "sequence_sizes" in batch


def pair_count(batch: dict[str, torch.Tensor]) -> int:
    if padding_free_layout(batch):
        return len(batch["sequence_sizes"]) // 2
    if shared_prompt_layout(batch):
        return int(batch["chosen_lengths"].shape[0])
    return int(batch["input_ids"].shape[0]) // 2


def real_token_count(batch: dict[str, torch.Tensor]) -> int:
    """Tokens the model computes that are not padding (the prompt counts once in the shared layout)."""
    if shared_prompt_layout(batch):
        return int((batch["branch"] >= 0).sum())
    if padding_free_layout(batch):
        return int(batch["input_ids"].numel())
    return int(batch["attention_mask"].sum())


def completion_lengths(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Completion tokens of each chosen and each rejected sequence: ``([B], [B])``."""
    if shared_prompt_layout(batch):
        return batch["chosen_lengths"], batch["rejected_lengths"]
    if padding_free_layout(batch):  # each sequence's first token is 0 in the mask, as [:, 1:] drops it below
        lengths = torch.stack([part.sum() for part in batch["completion_mask"][0].split(batch["sequence_sizes"])])
        half = lengths.shape[0] // 2
        return lengths[:half], lengths[half:]
    lengths = batch["completion_mask"][:, 1:].sum(-1)
    half = lengths.shape[0] // 2
    return lengths[:half], lengths[half:]


def completion_token_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token completion log-probs of the 2B sequences (chosen first): ``(logps [2B, L], mask [2B, L])``.

    Shared-prefix layout: one forward, logits only where a completion token is predicted. Classic layout: one
    forward over the padded chosen and rejected rows. Masked entries hold 0.
    """
    token_logps, mask, _ = completion_token_logps_and_alignment(model, batch, alignment=False)
    return token_logps, mask


def completion_token_logps_and_alignment(model: torch.nn.Module, batch: dict[str, torch.Tensor], alignment: bool):
    """``completion_token_logps`` plus, when ``alignment``, each completion token's ``log sum_v p_v^2``
    (``[2B, L]``, detached, 0 where masked; what WPO's weights read), from the same forward; else ``None``."""
    if padding_free_layout(batch):
        logits = sft_logits(model, batch)  # one row, attention kept inside each sequence
        token_logps, mask = completion_logps(logits, batch["input_ids"], batch["completion_mask"])
        squares = log_sum_squared_probs(logits[:, :-1, :]).masked_fill(~mask, 0.0) if alignment else None
        sizes = batch["sequence_sizes"]
        return (unpack_row(token_logps, sizes), unpack_row(mask, sizes),
                unpack_row(squares, sizes) if alignment else None)
    if not shared_prompt_layout(batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        token_logps, mask = completion_logps(logits, batch["input_ids"], batch["completion_mask"])
        if not alignment:
            return token_logps, mask, None
        return token_logps, mask, log_sum_squared_probs(logits[:, :-1, :]).masked_fill(~mask, 0.0)
    logits = shared_prefix_logits(model, batch)
    token_logps, mask = scatter_to_sequences(selective_log_softmax(logits, batch["targets"]), batch, 2 * pair_count(batch))
    if not alignment:
        return token_logps, mask, None
    squares, _ = scatter_to_sequences(log_sum_squared_probs(logits), batch, 2 * pair_count(batch), token_logps.shape[1])
    return token_logps, mask, squares


def unpack_row(values: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Per-position values ``[1, T-1]`` of a padding-free row (position ``t`` about token ``t+1``) -> ``[N, L-1]``
    per sequence, as a padded batch of the same sequences gives them (the value that would predict the next
    sequence's first token is dropped; the tail of shorter rows is 0)."""
    row = torch.cat([values[0], values.new_zeros(1)])
    width = max(sizes) - 1
    out = values.new_zeros(len(sizes), width)
    for i, part in enumerate(row.split(sizes)):
        out[i, : part.shape[0] - 1] = part[:-1]
    return out
