"""The pair-batch layouts of ``PreferenceDataModule`` seen from the model (shared-prompt, classic padded, classic
padding-free): how many pairs a batch holds, its
completion lengths, the per-token completion log-probs of one forward, and the run's layout as the adaptations check
names it (``DPOModule``, ``CPOModule`` and ``ORPOModule`` read them)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

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


def pair_batch_layout(datamodule: Any) -> tuple[str, int | None]:
    """The layout of ``PreferenceDataModule``'s pair batches (``adaptations.LAYOUTS``) and their longest sequence."""
    shared = getattr(datamodule, "prompt_sharing", False)
    # padding-free pairs are SFT's padding-free row (same forward, sft_logits): its conformance cell holds
    layout = ("dpo_shared" if shared else "padding_free" if getattr(datamodule, "padding_free", False)
              else "dpo_classic")
    return layout, getattr(datamodule, "max_length", None)


def warn_long_shared_rows(datamodule: Any, model: torch.nn.Module) -> None:
    """At fit start: warn when pairs share long rows under eager attention (quadratic in the row's length)."""
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    pack_length = getattr(datamodule, "pack_length", 0)
    if getattr(datamodule, "prompt_sharing", False) and (pack_length is None or pack_length > 512) \
            and attn == "eager":
        rank_zero_warn(f"Pairs share rows of about {pack_length or 'all the'} tokens (the datamodule's "
                       "pack_length), and eager attention computes every query against every key of a row: "
                       "its cost and memory grow with the square of the row. Set pack_length to about 512, "
                       "or use sdpa.")
