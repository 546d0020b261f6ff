"""The pair-batch layouts of ``PreferenceDataModule`` seen from the model (shared-prompt, classic padded, classic
padding-free): how many pairs a batch holds, its
completion lengths, the per-token completion log-probs of one forward (with, for ORPO's NLL, the chosen sequences'
prompt log-probs from that same forward), and the run's layout as the adaptations check names it (``DPOModule``,
``CPOModule`` and ``ORPOModule`` read them)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightalign.datamodules.shared_prefix import PROMPT
from lightalign.modules.training.logprobs import (
    completion_logps,
    log_sum_squared_probs,
    scatter_to_sequences,
    selective_log_softmax,
    shared_prefix_logits,
)
from lightalign.modules.training.sft_forward import sft_logits
from lightalign.vision.inputs import model_inputs


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
    forward over the padded chosen and rejected rows, with the rows' image inputs (``model_inputs``: each prompt's
    images for its chosen and its rejected row) and no ``position_ids``, so a multimodal-rotary model computes its
    own. Masked entries hold 0.
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
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                       **model_inputs(batch)).logits
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


def completion_and_prompt_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    """``completion_token_logps`` plus each chosen sequence's prompt part, from the same one forward:
    ``(logps [2B, L], mask [2B, L], prompt_logps [B], prompt_lengths [B])``, the summed log-probs of the chosen
    sequence's predicted prompt tokens (every prompt token but the first, which nothing predicts) and their count.

    What a cross-entropy over the whole chosen sequence needs (ORPO's NLL). The classic and padding-free layouts
    read them off logits they compute anyway; the shared-prompt layout adds the logits at the prompt positions of
    each segment to its forward (``shared_prompt_and_completion_logits``); the prompt, computed once per pair,
    is the chosen sequence's prompt.
    """
    half = pair_count(batch)
    if shared_prompt_layout(batch):
        logits, prompt_targets, prompt_pairs = shared_prompt_and_completion_logits(model, batch)
        count = batch["targets"].shape[0]
        token_logps, mask = scatter_to_sequences(selective_log_softmax(logits[:count], batch["targets"]), batch,
                                                 2 * half)
        prompt = selective_log_softmax(logits[count:], prompt_targets)
        prompt_logps = prompt.new_zeros(half).index_add(0, prompt_pairs, prompt)
        return token_logps, mask, prompt_logps, torch.bincount(prompt_pairs, minlength=half)
    if padding_free_layout(batch):
        logits = sft_logits(model, batch)
        targets, completion = batch["input_ids"][:, 1:], batch["completion_mask"][:, 1:].bool()
        prompt_mask = ~completion  # a sequence's first token: unpack_row drops the value predicting it
        every = selective_log_softmax(logits[:, :-1, :], targets)
        sizes = batch["sequence_sizes"]
        token_logps, mask = unpack_row(every.masked_fill(~completion, 0.0), sizes), unpack_row(completion, sizes)
        prompt_logps = unpack_row(every.masked_fill(~prompt_mask, 0.0), sizes)[:half].sum(-1)
        return token_logps, mask, prompt_logps, unpack_row(prompt_mask, sizes)[:half].sum(-1)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                       **model_inputs(batch)).logits
    every = selective_log_softmax(logits[:, :-1, :], batch["input_ids"][:, 1:])
    completion = batch["completion_mask"][:, 1:].bool()
    prompt_mask = batch["attention_mask"][:half, 1:].bool() & ~completion[:half]  # rows are right-padded
    return (every.masked_fill(~completion, 0.0), completion, every[:half].masked_fill(~prompt_mask, 0.0).sum(-1),
            prompt_mask.sum(-1))


def shared_prompt_and_completion_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    """One forward of a shared-prompt pair batch with logits also at the prompt positions that predict a prompt
    token: ``(logits [targets + P, V], prompt_targets [P], prompt_pairs [P])``, the first rows predicting
    ``batch["targets"]`` in order, the last ``P`` the prompt tokens ``prompt_targets`` of the pairs
    ``prompt_pairs``."""
    branch, positions = batch["branch"], batch["position_ids"]
    # column c predicts the prompt token at c + 1 when that token is a prompt token and not a segment's first
    predicts_prompt = torch.zeros_like(batch["logits_mask"])
    predicts_prompt[:, :-1] = (branch[:, 1:] == PROMPT) & (positions[:, 1:] > 0)
    keep = batch["logits_mask"] | predicts_prompt
    rank = keep.flatten().long().cumsum(0) - 1  # row of logits[keep] computed at each flat position
    completion_columns = torch.nonzero(batch["logits_mask"].flatten()).squeeze(1)[batch["target_logit_index"]]
    prompt_columns = torch.nonzero(predicts_prompt.flatten()).squeeze(1)
    # each pair's segment: the segments of a row are numbered from its start; a completion token's column names
    # its segment and its sequence id (i chosen, B + i rejected) names the pair
    segment = ((branch == PROMPT) & (positions == 0)).long().cumsum(-1).flatten() - 1
    row_of = torch.arange(branch.shape[0], device=branch.device).repeat_interleave(branch.shape[1])
    width = int(segment.max()) + 1
    pair_of_segment = torch.zeros(branch.shape[0] * width, dtype=torch.long, device=branch.device)
    pair_of_segment[row_of[completion_columns] * width + segment[completion_columns]] = (
        batch["target_sequence"] % pair_count(batch))
    prompt_pairs = pair_of_segment[row_of[prompt_columns] * width + segment[prompt_columns]]
    index = torch.cat([rank[completion_columns], rank[prompt_columns]])
    logits = shared_prefix_logits(model, {**batch, "logits_mask": keep, "target_logit_index": index})
    return logits, batch["input_ids"].flatten()[prompt_columns + 1], prompt_pairs


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
