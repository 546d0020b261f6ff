"""GRPO's loss as a pure function of tensors: TRL's loss types (surrogates and token normalisations),
``epsilon``/``epsilon_high`` clipping, ``delta``, token- or sequence-level importance sampling, the k3 KL penalty
``beta`` (optionally bias-corrected), the off-policy sequence mask, the high-entropy token mask, the entropy bonus
and the sampler-mismatch importance weight (``modules/losses/importance_sampling.py``). GRPOModule calls ``grpo_loss``;
the per-token terms live in ``grpo_surrogates.py``."""

from __future__ import annotations

import torch

from lightalign.modules.losses.grpo_surrogates import (IMPORTANCE_SAMPLING_LEVELS, cispo_surrogate, clipped_surrogate,
                                                log_importance_weights, off_policy_mask, sapo_surrogate,
                                                vespo_weights)
from lightalign.modules.losses.importance_sampling import check_ratio_shape

GRPO_LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO's clipped surrogate (where delta applies)
GLOBAL_TOKEN_LOSS_TYPES = ("dapo", "cispo", "vespo")  # divided by the optimizer step's tokens (num_items_in_batch)


def validate_grpo_loss_config(
    loss_type: str, epsilon: float, epsilon_high: float | None, beta: float, max_completion_length: int | None,
    *, importance_sampling_level: str = "token", delta: float | None = None, sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05, vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0, off_policy_mask_threshold: float | None = None,
    use_bias_correction_kl: bool = False, top_entropy_quantile: float = 1.0, entropy_coef: float = 0.0,
) -> None:
    """Check the GRPO loss knobs; raise ``ValueError`` naming the knob and what to do."""
    if loss_type not in GRPO_LOSS_TYPES:
        valid = ", ".join(repr(t) for t in GRPO_LOSS_TYPES)
        raise ValueError(f"Unknown GRPO loss_type {loss_type!r}; valid names are: {valid}.")
    if not epsilon > 0:
        raise ValueError(f"epsilon (lower clipping range, ratio >= 1 - epsilon) must be > 0 (TRL uses 0.2), "
                         f"got {epsilon}.")
    if loss_type == "cispo" and epsilon_high is None:
        raise ValueError("loss_type 'cispo' caps the importance ratio at epsilon_high itself (not 1 + epsilon_high); "
                         "set epsilon_high explicitly (ScaleRL recommends 5.0). TRL falls back to epsilon (0.2), "
                         "which would scale every token's gradient by 0.2.")
    if epsilon_high is not None and not epsilon_high >= epsilon:
        raise ValueError(f"epsilon_high must be >= epsilon ({epsilon}), got {epsilon_high}; leave it unset to "
                         "use epsilon for both sides (DAPO recommends epsilon_high=0.28 with epsilon=0.2).")
    if not beta >= 0:
        raise ValueError(f"beta (KL coefficient) must be >= 0 (0.0 disables the KL term), got {beta}.")
    if loss_type == "dr_grpo" and (max_completion_length is None or not max_completion_length > 0):
        raise ValueError(f"loss_type 'dr_grpo' divides by batch_size * max_completion_length; pass a positive "
                         f"max_completion_length (got {max_completion_length}).")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r} is unknown; use 'token' or "
                         "'sequence' (GSPO).")
    if loss_type == "luspo" and importance_sampling_level != "sequence":
        raise ValueError("loss_type 'luspo' scales each sequence's loss by its length and needs "
                         "importance_sampling_level='sequence' (TRL only warns, and then sums each completion's "
                         "token-level ratio losses instead).")
    if loss_type == "vespo" and importance_sampling_level != "token":
        raise ValueError("loss_type 'vespo' builds its own sequence-level weight from the token log-ratios; leave "
                         "importance_sampling_level='token'.")
    if delta is not None:
        if loss_type not in CLIPPED_LOSS_TYPES:
            raise ValueError(f"delta (two-sided clipping) applies to the clipped loss types {list(CLIPPED_LOSS_TYPES)}, "
                             f"not {loss_type!r}; unset delta.")
        if not delta > 1:
            raise ValueError(f"delta caps the importance ratio of the unclipped branch and must be > 1 (INTELLECT-2 "
                             f"recommends > 1 + epsilon, e.g. 4.0), got {delta}.")
    for name, value in (("sapo_temperature_pos", sapo_temperature_pos), ("sapo_temperature_neg", sapo_temperature_neg),
                        ("vespo_lambda_pos", vespo_lambda_pos), ("vespo_lambda_neg", vespo_lambda_neg)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 (TRL's defaults: sapo 1.0 / 1.05, vespo lambda 3.0 / 2.0), got {value}.")
    for name, value in (("vespo_k_pos", vespo_k_pos), ("vespo_k_neg", vespo_k_neg)):
        if not value >= 0:
            raise ValueError(f"{name} (power of the VESPO Gamma weight) must be >= 0 (TRL: 2.0 / 3.0), got {value}.")
    if off_policy_mask_threshold is not None and not off_policy_mask_threshold > 0:
        raise ValueError(f"off_policy_mask_threshold must be > 0 (DeepSeek-V3.2 uses e.g. 0.5) or null, got "
                         f"{off_policy_mask_threshold}.")
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1] (1.0 keeps every token, the paper uses 0.2), got "
                         f"{top_entropy_quantile}.")
    if not entropy_coef >= 0:
        raise ValueError(f"entropy_coef must be >= 0 (0.0 disables the entropy bonus), got {entropy_coef}.")


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
    importance_sampling_level: str = "token",
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    off_policy_mask_threshold: float | None = None,
    use_bias_correction_kl: bool = False,
    entropy_mask: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    loss_scale: float = 1.0,
    importance_sampling_ratio: torch.Tensor | None = None,
    sampling_per_token_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's loss with TRL's loss types (``GRPOTrainer._compute_loss``).

    Per token, with ``r = exp(w)``, ``w = logp - old_logp`` (``importance_sampling_level='token'``) or each row's
    mean of it broadcast to its tokens (``'sequence'``, GSPO), and ``A`` the row's advantage, the policy term is:
      - ``grpo``/``bnpo``/``dr_grpo``/``dapo``/``luspo``: ``-min(min(r, delta) A, clamp(r, 1 - epsilon, 1 +
        epsilon_high) A)`` (``delta`` only when set: two-sided clipping);
      - ``cispo``: ``-sg(min(r, epsilon_high)) A logp``;
      - ``sapo``: ``-(4 / tau) sigmoid(tau (r - 1)) A`` (``tau`` = ``sapo_temperature_pos`` if ``A > 0`` else ``_neg``);
      - ``vespo``: ``-sg(phi(W)) A logp``, ``phi`` the Gamma weight of the sequence ratio ``W`` (``vespo_*`` knobs).
    The policy term is multiplied by the off-policy mask (``off_policy_mask_threshold``: rows with ``A < 0`` whose
    mean ``base_logp - logp`` exceeds it get 0, ``base_logp`` = ``sampling_per_token_logps`` when given (a NaN
    difference counts as 0), else ``old_logp``), by ``entropy_mask`` (the high-entropy tokens,
    ``top_entropy_quantile``) and by ``rho``, the detached ``importance_sampling_ratio`` ``pi_old / pi_sampler``
    (``[B, T]`` per token or ``[B, 1]`` per row, from ``modules/losses/importance_sampling.py``), except for ``vespo``,
    where ``sum_t log rho`` (each ``log rho`` clamped to [log 1e-8, 20]) is added to ``log W`` instead, so ``W`` is
    ``pi / pi_sampler``. Then ``beta * k3_t`` is added on every token, ``k3_t = exp(ref - logp) - (ref - logp) - 1``
    (not multiplied by ``rho``), times ``r`` (with its gradient) when ``use_bias_correction_kl``. So per token:
    ``loss_t = policy_t * opm_i * entropy_mask_t * rho + beta * k3_t``, as TRL 1.16 (``vllm_importance_sampling_*``).

    Reduction over the ``[B, T]`` masked losses (``S`` = masked sum, ``n_i`` = tokens of row ``i``):
      - ``grpo``, ``sapo``: ``mean_i(sum_t loss / max(n_i, 1))`` (an empty row counts in the mean with 0, like TRL);
      - ``bnpo``:    ``S / max(sum n_i, 1)``, this micro-batch's own token count;
      - ``dr_grpo``: ``S / (B * max_completion_length)``;
      - ``dapo``, ``cispo``, ``vespo``: ``S / max(num_items_in_batch, 1)``, default ``completion_mask.sum()``;
      - ``luspo``:   ``S / B`` = ``mean_i(sum_t loss)``, each completion's sum over its real tokens (padding
        masked before the sum, as TRL 1.16.0 does), averaged over the completions. With ``beta = 0`` and no
        ``entropy_mask`` that is ``mean_i(L_i n_i)``, each sequence's loss ``L_i`` times its length; an
        ``entropy_mask`` counts ``L_i`` once per kept token instead, and ``beta`` adds ``beta * sum_t k3_t`` per row.
    ``num_items_in_batch`` is read by the ``dapo``-like types only (TRL's bnpo uses the local count).

    Entropy bonus (``entropy_coef`` with ``entropies``, the ``[B, T]`` per-token entropies carrying their graph):
    ``loss -= entropy_coef * H / loss_scale`` with ``H`` this micro-batch's mean entropy over the real tokens (of
    ``entropy_mask`` when given), for every loss type, as TRL 1.16 defines it. ``loss_scale`` is the factor the
    caller multiplies the returned loss by (``GRPOModule``: ``accumulate_grad_batches`` for the ``dapo``-like types,
    whose ``num_items_in_batch`` spans the step), so that after Lightning's division by the accumulation the
    bonus is ``H / accumulate_grad_batches`` for every type, as in TRL.

    Gradient accumulation: Lightning divides the returned loss by ``accumulate_grad_batches`` (K).
      - ``dapo``-like: pass ``num_items_in_batch`` = completion tokens of the whole optimizer step (all K micro-batches)
        and multiply the returned loss by K; the accumulated gradient is then ``grad(sum_k S_k) / N`` = the one-big-
        batch gradient. Under DDP (gradients averaged over W ranks) pass the global count / W, as TRL does.
        ``GRPOModule`` counts each optimizer step's own tokens also when a rollout spans several optimizer steps;
        TRL 1.16 then uses the rollout's count x K / steps_per_generation (its average step): deliberately
        different, so that a step's gradient is the token mean of the tokens it trains on.
      - ``grpo`` / ``sapo`` / ``dr_grpo`` / ``luspo``: return as is. With K micro-batches of equal size b, the
        per-batch loss is ``(1/b) sum_{i in k} x_i`` and Lightning's ``sum_k (.) / K = (1/(bK)) sum_i x_i``, exactly
        the loss of one batch of ``bK`` rows.
      - ``bnpo`` is NOT invariant: ``mean_k(S_k / N_k) != sum_k S_k / sum_k N_k`` when micro-batches hold different
        token counts (TRL documents the same local-batch dependence).

    ``old_per_token_logps=None`` means on-policy (``per_token_logps.detach()``, ratio 1). Values under a zero mask
    are never read (they may be -inf/nan) and get exactly zero gradient. Computed in float32 (float64 if the
    log-probs are). Returns ``(loss, stats)`` with detached local masked means ``clip_ratio/low_mean`` (r <
    1 - epsilon with A < 0), ``clip_ratio/high_mean`` (r > 1 + epsilon_high with A > 0; for ``cispo``: r >
    epsilon_high with A > 0), ``clip_ratio/region_mean`` (either), ``kl`` when beta > 0, ``policy_loss`` (the loss
    before the entropy bonus) and ``entropy_bonus`` (``H``) when ``entropy_coef`` is given with ``entropies``.
    """
    validate_grpo_loss_config(
        loss_type, epsilon, epsilon_high, beta, max_completion_length,
        importance_sampling_level=importance_sampling_level, delta=delta, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg, off_policy_mask_threshold=off_policy_mask_threshold,
        use_bias_correction_kl=use_bias_correction_kl, entropy_coef=entropy_coef,
    )
    eps_high = epsilon if epsilon_high is None else epsilon_high
    if per_token_logps.dim() != 2 or completion_mask.shape != per_token_logps.shape:
        raise ValueError(f"per_token_logps and completion_mask must both be [B, T]; got {tuple(per_token_logps.shape)}"
                         f" and {tuple(completion_mask.shape)}.")
    if advantages.shape != per_token_logps.shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(per_token_logps.shape[:1])}, got {tuple(advantages.shape)}.")
    if beta > 0 and ref_per_token_logps is None:
        raise ValueError(f"beta={beta} > 0 needs ref_per_token_logps (the reference model's [B, T] log-probs); "
                         "pass them or set beta=0.0.")
    for name, extra in (("entropy_mask", entropy_mask), ("entropies", entropies),
                        ("sampling_per_token_logps", sampling_per_token_logps)):
        if extra is not None and extra.shape != per_token_logps.shape:
            raise ValueError(f"{name} must be [B, T] = {tuple(per_token_logps.shape)}, got {tuple(extra.shape)}.")
    check_ratio_shape(importance_sampling_ratio, per_token_logps)
    dtype = torch.float64 if per_token_logps.dtype == torch.float64 else torch.float32
    mask = completion_mask.bool()
    zero = torch.zeros((), dtype=dtype, device=per_token_logps.device)

    def masked(x: torch.Tensor) -> torch.Tensor:  # zero out padding *before* exp, so -inf there cannot poison grads
        return torch.where(mask, x.to(dtype), zero)

    logp = masked(per_token_logps)
    old = logp.detach() if old_per_token_logps is None else masked(old_per_token_logps).detach()
    adv = advantages.to(dtype).detach().unsqueeze(1)  # [B, 1]
    log_ratio = logp - old
    ratio = torch.exp(log_importance_weights(log_ratio, mask, importance_sampling_level))
    rho = None
    if importance_sampling_ratio is not None:  # [B, T]: 1 on padding, so nothing there reaches a gradient or a sum
        rho = importance_sampling_ratio.detach().to(dtype)
        if rho.shape[1] != 1:
            rho = torch.where(mask, rho, torch.ones((), dtype=dtype, device=rho.device))
    if loss_type == "cispo":
        policy = cispo_surrogate(ratio, logp, adv, eps_high)
    elif loss_type == "sapo":
        policy = sapo_surrogate(ratio, adv, sapo_temperature_pos, sapo_temperature_neg)
    elif loss_type == "vespo":
        phi = vespo_weights(log_ratio, mask, adv, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, rho)
        policy = -phi * adv * logp
    else:
        policy = clipped_surrogate(ratio, adv, epsilon, eps_high, delta)
    if off_policy_mask_threshold is not None:
        base = old if sampling_per_token_logps is None else masked(sampling_per_token_logps).detach()
        policy = policy * off_policy_mask(logp, base, mask, adv, off_policy_mask_threshold)
    if entropy_mask is not None:
        policy = policy * entropy_mask.to(dtype).detach()
    if rho is not None and loss_type != "vespo":
        policy = policy * rho
    per_token_loss = policy
    if beta > 0:
        ref_minus_logp = masked(ref_per_token_logps).detach() - logp
        kl = torch.exp(ref_minus_logp) - ref_minus_logp - 1
        if use_bias_correction_kl:
            kl = kl * ratio
        per_token_loss = per_token_loss + beta * kl
    per_token_loss = torch.where(mask, per_token_loss, zero)

    m = mask.to(dtype)
    total = per_token_loss.sum()
    count = None
    if loss_type in ("grpo", "sapo"):
        loss = (per_token_loss.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = total / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = total / (per_token_loss.size(0) * max_completion_length)
    elif loss_type == "luspo":  # masked per-row sums (KL and entropy mask already per token), mean over rows
        loss = total / per_token_loss.size(0)
    else:  # dapo, cispo, vespo
        count = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=m.device)
        count = count.to(dtype).clamp(min=1.0)
        loss = total / count

    stats: dict[str, torch.Tensor] = {}
    if entropy_coef and entropies is not None:
        stats["policy_loss"] = loss.detach()
        selected = m if entropy_mask is None else m * entropy_mask.to(dtype).detach()
        summed = torch.where(mask, entropies.to(dtype), zero).mul(selected).sum()
        bonus = summed / selected.sum().clamp(min=1.0)
        stats["entropy_bonus"] = bonus.detach()
        loss = loss - entropy_coef * bonus / loss_scale

    with torch.no_grad():
        n = m.sum().clamp(min=1.0)
        if loss_type == "cispo":
            low = torch.zeros_like(mask)
            high = (ratio > eps_high) & (adv > 0) & mask
        else:
            capped = ratio if delta is None else torch.clamp(ratio, max=delta)
            low = (capped < 1 - epsilon) & (adv < 0) & mask
            high = (capped > 1 + eps_high) & (adv > 0) & mask
        if loss_type in CLIPPED_LOSS_TYPES or loss_type == "cispo":
            stats["clip_ratio/low_mean"] = low.to(dtype).sum() / n
            stats["clip_ratio/high_mean"] = high.to(dtype).sum() / n
            stats["clip_ratio/region_mean"] = (low | high).to(dtype).sum() / n
        if loss_type == "vespo":
            stats["vespo/phi_seq_mean"] = phi.mean()
        if beta > 0:
            stats["kl"] = (kl * m).sum() / n
    return loss, stats
