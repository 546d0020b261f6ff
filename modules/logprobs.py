"""Per-token and per-sequence log-probabilities of given tokens, without a full-vocabulary float32 copy.

``selective_log_softmax`` computes ``log_softmax(logits)[token]`` as ``logit[token] - logsumexp(logits)`` row
chunk by row chunk, so at most ``chunk_rows x vocab`` float32 values exist at a time, whatever the batch.
"""

from __future__ import annotations

import torch


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """``log_softmax(logits, -1).gather(-1, index)`` for ``logits [..., V]`` and ``index [...]``, memory-light."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_index = index.reshape(-1)
    out = torch.empty(flat_index.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, flat_logits.shape[0], chunk_rows):
        rows = flat_logits[start : start + chunk_rows].float()
        picked = rows.gather(-1, flat_index[start : start + chunk_rows].unsqueeze(-1)).squeeze(-1)
        out[start : start + chunk_rows] = picked - torch.logsumexp(rows, dim=-1)
    return out.view(index.shape)


def completion_logps(
    logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the completion tokens: ``(token_logps [N, T-1], mask [N, T-1])``.

    Position ``t`` of the outputs is the log-prob of ``input_ids[:, t+1]`` given the tokens before it; the mask
    is ``completion_mask[:, 1:]`` (prompt and padding are 0). Masked positions hold 0.
    """
    targets = input_ids[:, 1:]
    mask = completion_mask[:, 1:].bool()
    token_logps = selective_log_softmax(logits[:, :-1, :], targets)
    return token_logps.masked_fill(~mask, 0.0), mask


def sequence_logps(
    logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-prob of each sequence and its completion length: ``(logps [N], lengths [N])``."""
    token_logps, mask = completion_logps(logits, input_ids, completion_mask)
    return token_logps.sum(-1), mask.sum(-1)
