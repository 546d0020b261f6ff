"""Token normalisations: how a masked per-token loss ``[B, T]`` becomes the scalar loss, registered by name
(``register_aggregation``) for the policy losses to name. ``S`` is the masked sum, ``n_i`` the real tokens of row
``i``, ``B`` the rows.

Under gradient accumulation Lightning divides the returned loss by ``accumulate_grad_batches``; ``grpo_loss``
says which aggregations are then invariant to how the step is cut into micro-batches.
"""

from __future__ import annotations

import torch

from lightalign.modules.losses.registry import register_aggregation


@register_aggregation("sequence_mean")
def sequence_mean(per_token_loss: torch.Tensor, mask: torch.Tensor, **_: object) -> torch.Tensor:
    """``mean_i(sum_t loss / max(n_i, 1))``: each completion's token mean, averaged over the completions (an empty
    row counts in the mean with 0). TRL's ``grpo`` and ``sapo``."""
    return (per_token_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


@register_aggregation("token_mean")
def token_mean(per_token_loss: torch.Tensor, mask: torch.Tensor, **_: object) -> torch.Tensor:
    """``S / max(sum_i n_i, 1)``: the token mean of this micro-batch's own tokens (TRL's ``bnpo``)."""
    return per_token_loss.sum() / mask.sum().clamp(min=1.0)


@register_aggregation("max_length")
def max_length(per_token_loss: torch.Tensor, mask: torch.Tensor, *, max_completion_length: int | None = None,
               **_: object) -> torch.Tensor:
    """``S / (B * max_completion_length)``: a constant normaliser, so no length bias (Dr. GRPO, TRL's
    ``dr_grpo``); ``max_completion_length`` is the sampling limit (checked >= 1 where it is configured)."""
    if max_completion_length is None or not max_completion_length > 0:
        raise ValueError(f"loss_type 'dr_grpo' divides by batch_size * max_completion_length; pass a positive "
                         f"max_completion_length (got {max_completion_length}).")
    return per_token_loss.sum() / (per_token_loss.size(0) * max_completion_length)


@register_aggregation("sequence_sum")
def sequence_sum(per_token_loss: torch.Tensor, mask: torch.Tensor, **_: object) -> torch.Tensor:
    """``S / B = mean_i(sum_t loss)``: each completion's sum over its real tokens, averaged over the completions
    (TRL's ``luspo``: a sequence-level loss scaled by its length)."""
    return per_token_loss.sum() / per_token_loss.size(0)


@register_aggregation("step_token_mean", step_tokens=True)
def step_token_mean(per_token_loss: torch.Tensor, mask: torch.Tensor, *,
                    num_items_in_batch: torch.Tensor | float | None = None, **_: object) -> torch.Tensor:
    """``S / max(num_items_in_batch, 1)``, by default ``mask.sum()``: the token mean over the completion tokens of
    the whole optimizer step when the caller passes their count (TRL's ``dapo``, ``cispo``, ``vespo``)."""
    count = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=mask.device)
    return per_token_loss.sum() / count.to(per_token_loss.dtype).clamp(min=1.0)
