"""GRPO's clipped surrogate loss as pure functions of tensors, with TRL's loss types (token normalisations),
``epsilon``/``epsilon_high`` clipping and the k3 KL penalty ``beta``. GRPOModule calls ``grpo_loss``."""

from __future__ import annotations

import torch

GRPO_LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")


def validate_grpo_loss_config(
    loss_type: str, epsilon: float, epsilon_high: float | None, beta: float, max_completion_length: int | None
) -> None:
    """Check the GRPO loss knobs; raise ``ValueError`` saying what to fix."""
    if loss_type not in GRPO_LOSS_TYPES:
        valid = ", ".join(repr(t) for t in GRPO_LOSS_TYPES)
        raise ValueError(f"Unknown GRPO loss_type {loss_type!r}; valid names are: {valid}.")
    if not epsilon > 0:
        raise ValueError(f"epsilon (lower clipping range, ratio >= 1 - epsilon) must be > 0 (TRL uses 0.2), "
                         f"got {epsilon}.")
    if epsilon_high is not None and not epsilon_high >= epsilon:
        raise ValueError(f"epsilon_high must be >= epsilon ({epsilon}), got {epsilon_high}; leave it unset to "
                         "use epsilon for both sides (DAPO recommends epsilon_high=0.28 with epsilon=0.2).")
    if not beta >= 0:
        raise ValueError(f"beta (KL coefficient) must be >= 0 (0.0 disables the KL term), got {beta}.")
    if loss_type == "dr_grpo" and (max_completion_length is None or not max_completion_length > 0):
        raise ValueError(f"loss_type 'dr_grpo' divides by batch_size * max_completion_length; pass a positive "
                         f"max_completion_length (got {max_completion_length}).")


def grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_per_token_logps: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped GRPO loss (TRL's ``GRPOTrainer._compute_loss``, token-level importance sampling).

    Per token, with ``r = exp(logp - old_logp)`` and ``A`` the row's advantage::

        loss_t = -min(r * A, clamp(r, 1 - epsilon, 1 + epsilon_high) * A) + beta * k3_t
        k3_t   = exp(ref - logp) - (ref - logp) - 1                      (only when beta > 0)

    Reduction over the ``[B, T]`` masked losses (``S`` = masked sum, ``n_i`` = tokens of row ``i``):
      - ``grpo``:    ``mean_i(sum_t loss / max(n_i, 1))`` (an empty row counts in the mean with 0, like TRL);
      - ``bnpo``:    ``S / max(sum n_i, 1)``, this micro-batch's own token count;
      - ``dr_grpo``: ``S / (B * max_completion_length)``;
      - ``dapo``:    ``S / max(num_items_in_batch, 1)``, default ``completion_mask.sum()``.
    ``num_items_in_batch`` is read by ``dapo`` only (TRL's bnpo uses the local count); other types ignore it.

    Gradient accumulation: Lightning divides the returned loss by ``accumulate_grad_batches`` (K).
      - ``dapo``: pass ``num_items_in_batch`` = completion tokens of the whole optimizer step (all K micro-batches)
        and multiply the returned loss by K; the accumulated gradient is then ``grad(sum_k S_k) / N`` = the one-big-
        batch gradient. Under DDP (gradients averaged over W ranks) pass the global count / W, as TRL does.
        ``GRPOModule`` counts each optimizer step's own tokens also when a rollout spans several optimizer steps;
        TRL 1.16 then uses the rollout's count x K / steps_per_generation (its average step): deliberately
        different, so that a step's gradient is the token mean of the tokens it trains on.
      - ``grpo`` / ``dr_grpo``: return as is. With K micro-batches of equal size b, the per-batch loss is
        ``(1/b) sum_{i in k} x_i`` (x_i = row loss, resp. row sum / max_completion_length), and Lightning's
        ``sum_k (.) / K = (1/(bK)) sum_i x_i``, exactly the loss of one batch of ``bK`` rows.
      - ``bnpo`` is NOT invariant: ``mean_k(S_k / N_k) != sum_k S_k / sum_k N_k`` when micro-batches hold different
        token counts (TRL documents the same local-batch dependence).

    ``old_per_token_logps=None`` means on-policy (``per_token_logps.detach()``, ratio 1). Values under a zero mask
    are never read (they may be -inf/nan) and get exactly zero gradient. Computed in float32 (float64 if the
    log-probs are). Returns ``(loss, stats)`` with detached local masked means ``clip_ratio/low_mean`` (r <
    1 - epsilon with A < 0), ``clip_ratio/high_mean`` (r > 1 + epsilon_high with A > 0), ``clip_ratio/region_mean``
    (either: the tokens where the clipped branch is active and gives no gradient) and, when beta > 0, ``kl``.
    """
    validate_grpo_loss_config(loss_type, epsilon, epsilon_high, beta, max_completion_length)
    eps_high = epsilon if epsilon_high is None else epsilon_high
    if per_token_logps.dim() != 2 or completion_mask.shape != per_token_logps.shape:
        raise ValueError(f"per_token_logps and completion_mask must both be [B, T]; got {tuple(per_token_logps.shape)}"
                         f" and {tuple(completion_mask.shape)}.")
    if advantages.shape != per_token_logps.shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(per_token_logps.shape[:1])}, got {tuple(advantages.shape)}.")
    if beta > 0 and ref_per_token_logps is None:
        raise ValueError(f"beta={beta} > 0 needs ref_per_token_logps (the reference model's [B, T] log-probs); "
                         "pass them or set beta=0.0.")
    dtype = torch.float64 if per_token_logps.dtype == torch.float64 else torch.float32
    mask = completion_mask.bool()
    zero = torch.zeros((), dtype=dtype, device=per_token_logps.device)

    def masked(x: torch.Tensor) -> torch.Tensor:  # zero out padding *before* exp, so -inf there cannot poison grads
        return torch.where(mask, x.to(dtype), zero)

    logp = masked(per_token_logps)
    old = logp.detach() if old_per_token_logps is None else masked(old_per_token_logps).detach()
    adv = advantages.to(dtype).detach().unsqueeze(1)  # [B, 1]
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
    per_token_loss = -torch.minimum(ratio * adv, clipped * adv)
    if beta > 0:
        ref_minus_logp = masked(ref_per_token_logps).detach() - logp
        kl = torch.exp(ref_minus_logp) - ref_minus_logp - 1
        per_token_loss = per_token_loss + beta * kl
    per_token_loss = torch.where(mask, per_token_loss, zero)

    m = mask.to(dtype)
    total = per_token_loss.sum()
    if loss_type == "grpo":
        loss = (per_token_loss.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = total / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = total / (per_token_loss.size(0) * max_completion_length)
    else:  # dapo
        count = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=m.device)
        loss = total / count.to(dtype).clamp(min=1.0)

    with torch.no_grad():
        n = m.sum().clamp(min=1.0)
        low = (ratio < 1 - epsilon) & (adv < 0) & mask
        high = (ratio > 1 + eps_high) & (adv > 0) & mask
        stats = {
            "clip_ratio/low_mean": low.to(dtype).sum() / n,
            "clip_ratio/high_mean": high.to(dtype).sum() / n,
            "clip_ratio/region_mean": (low | high).to(dtype).sum() / n,
        }
        if beta > 0:
            stats["kl"] = (kl * m).sum() / n
    return loss, stats
