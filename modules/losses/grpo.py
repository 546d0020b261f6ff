"""GRPO's loss as a pure function of tensors: TRL's loss types (registered policy losses with their token
normalisations), ``epsilon``/``epsilon_high`` clipping, ``delta``, token- or sequence-level importance sampling, the
k3 KL penalty ``beta`` (optionally bias-corrected), the off-policy sequence mask, the high-entropy token mask, the
entropy bonus and the sampler-mismatch importance weight. ``GRPOLossConfig`` holds the loss knobs; ``grpo_loss``
dispatches on ``loss_type`` through the policy-loss registry (``registry.policy_loss``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

import lightalign.modules.losses.gmpo  # noqa: F401  (registers the gmpo policy loss)
from lightalign.knobs import KnobGroup, knob
from lightalign.modules.losses.grpo_surrogates import (IMPORTANCE_SAMPLING_LEVELS, log_importance_weights,
                                                       off_policy_mask)
from lightalign.modules.losses.registry import (ENTROPY_MASK, IMPORTANCE_SAMPLING_RATIO, POLICY_LOSSES, PolicyInputs,
                                                aggregation, normalises_by_step_tokens, policy_loss)
from lightalign.modules.losses.importance_sampling import check_ratio_shape

__all__ = ["GRPOLossConfig", "GRPO_LOSS_TYPES", "grpo_loss", "normalises_by_step_tokens"]

GRPO_LOSS_TYPES: tuple[str, ...] = POLICY_LOSSES.names()  # the built-in ones, registered on import


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig(KnobGroup):
    """GRPO's loss knobs (TRL's names and defaults), checked once when built; ``grpo_loss`` reads them."""

    group = "loss"
    loss_type: Literal["dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo", "gmpo"] = knob(
        "dapo", "``dapo`` (default) | ``grpo`` | ``bnpo`` | ``dr_grpo`` | ``cispo`` | ``sapo`` | ``luspo`` | "
        "``vespo`` | ``gmpo`` (formulas: ``grpo_loss``; GMPO: set ``epsilon: 0.4``, TRL's GMPO default). ``cispo`` "
        "needs ``epsilon_high`` (the ratio cap, e.g. 5.0); ``luspo`` needs ``importance_sampling_level: sequence``; "
        "``beta > 0`` and ``top_entropy_quantile < 1`` combine with it as in TRL 1.16.0 (each completion's masked "
        "token sum, averaged over completions). ``dapo`` divides by the completion tokens of each optimizer step's own "
        "micro-batches; when ``steps_per_generation`` exceeds ``accumulate_grad_batches`` TRL 1.16 divides by the "
        "rollout's tokens times ``accumulate / steps`` (an average over the rollout) instead. Deliberately: each "
        "step's gradient is then the token mean of exactly the tokens it trains on, whatever the lengths in the "
        "rollout's other steps.")
    epsilon: float = knob(0.2, "lower clipping range: the importance ratio is clipped below at ``1 - epsilon`` "
                               "(TRL: 0.2); for ``gmpo`` the log-ratio at ``-epsilon`` (TRL's GMPO: 0.4).")
    epsilon_high: float | None = knob(None, "upper clipping range: clipped above at ``1 + epsilon_high``; None: "
                                            "``epsilon`` (DAPO's clip-higher uses e.g. 0.28; ``cispo``'s ratio cap, "
                                            "e.g. 5.0; ``gmpo``'s log-ratio bound).")
    delta: float | None = knob(None, "two-sided clipping (INTELLECT-2): the unclipped branch uses "
                                     "``min(ratio, delta)``; > 1, e.g. 4.0.")
    importance_sampling_level: Literal["token", "sequence"] = knob(
        "token", "``token`` (default) or ``sequence`` (GSPO: each completion's mean log-ratio, one ratio per "
                 "completion).")
    sapo_temperature_pos: float = knob(1.0, "SAPO's gate temperature for tokens with a positive advantage (> 0).")
    sapo_temperature_neg: float = knob(1.05, "SAPO's gate temperature for the other tokens (> 0).")
    vespo_k_pos: float = knob(2.0, "VESPO's Gamma weight ``w^k exp(-lambda w)``: ``k`` for non-negative advantages.")
    vespo_lambda_pos: float = knob(3.0, "VESPO's ``lambda`` for non-negative advantages.")
    vespo_k_neg: float = knob(3.0, "VESPO's ``k`` for negative advantages.")
    vespo_lambda_neg: float = knob(2.0, "VESPO's ``lambda`` for negative advantages.")
    off_policy_mask_threshold: float | None = knob(
        None, "drop completions with a negative advantage whose mean ``log pi_old - log pi`` exceeds it "
              "(DeepSeek-V3.2). Only acts when the rollout is reused (``num_iterations > 1`` or "
              "``steps_per_generation > accumulate_grad_batches``); otherwise the policy is the sampler.")
    use_bias_correction_kl: bool = knob(
        True, "multiply the k3 term by the importance ratio (DeepSeek-V3.2's unbiased estimate; on by default, as "
              "in TRL 1.16; no effect when ``beta`` is 0).")

    def check(self) -> None:
        entry = policy_loss(self.loss_type)  # an unknown name is refused, listing the registered ones
        if not self.epsilon > 0:
            raise ValueError(f"epsilon (lower clipping range, ratio >= 1 - epsilon) must be > 0 (TRL uses 0.2), "
                             f"got {self.epsilon}.")
        if self.epsilon_high is not None and not self.epsilon_high >= self.epsilon:
            raise ValueError(f"epsilon_high must be >= epsilon ({self.epsilon}), got {self.epsilon_high}; leave it "
                             "unset to use epsilon for both sides (DAPO recommends epsilon_high=0.28 with "
                             "epsilon=0.2).")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level={self.importance_sampling_level!r} is unknown; use 'token' "
                             "or 'sequence' (GSPO).")
        if entry.check is not None:
            entry.check(self)
        if self.delta is not None:
            if not entry.reads_delta:
                clipped = [name for name, e in POLICY_LOSSES.entries.items() if e.reads_delta]
                raise ValueError(f"delta (two-sided clipping) applies to the clipped loss types {clipped}, not "
                                 f"{self.loss_type!r}; unset delta.")
            if not self.delta > 1:
                raise ValueError(f"delta caps the importance ratio of the unclipped branch and must be > 1 "
                                 f"(INTELLECT-2 recommends > 1 + epsilon, e.g. 4.0), got {self.delta}.")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (TRL's defaults: sapo 1.0 / 1.05, vespo lambda 3.0 / 2.0), "
                                 f"got {getattr(self, name)}.")
        for name in ("vespo_k_pos", "vespo_k_neg"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} (power of the VESPO Gamma weight) must be >= 0 (TRL: 2.0 / 3.0), got "
                                 f"{getattr(self, name)}.")
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold > 0:
            raise ValueError(f"off_policy_mask_threshold must be > 0 (DeepSeek-V3.2 uses e.g. 0.5) or null, got "
                             f"{self.off_policy_mask_threshold}.")


def grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    config: GRPOLossConfig | None = None,
    beta: float = 0.0,
    ref_per_token_logps: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    entropy_mask: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    loss_scale: float = 1.0,
    importance_sampling_ratio: torch.Tensor | None = None,
    sampling_per_token_logps: torch.Tensor | None = None,
    **knobs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's loss with TRL's loss types (``GRPOTrainer._compute_loss``), each a registered policy loss
    (``policy_loss(config.loss_type)``: its per-token term and its aggregation).

    ``config``: the loss knobs (``GRPOLossConfig``, checked once when built); without it, ``knobs`` are its fields
    by name (``loss_type="bnpo", epsilon_high=0.28``) and the config is built here. ``beta`` (the KL coefficient)
    and ``max_completion_length`` (read by ``dr_grpo``) belong to other knob groups and come as arguments.

    Per token, with ``r = exp(w)``, ``w = logp - old_logp`` (``importance_sampling_level='token'``) or each row's
    mean of it broadcast to its tokens (``'sequence'``, GSPO), and ``A`` the row's advantage, the policy term is:
      - ``grpo``/``bnpo``/``dr_grpo``/``dapo``/``luspo``: ``-min(min(r, delta) A, clamp(r, 1 - epsilon, 1 +
        epsilon_high) A)`` (``delta`` only when set: two-sided clipping);
      - ``cispo``: ``-sg(min(r, epsilon_high)) A logp``;
      - ``sapo``: ``-(4 / tau) sigmoid(tau (r - 1)) A`` (``tau`` = ``sapo_temperature_pos`` if ``A > 0`` else ``_neg``);
      - ``vespo``: ``-sg(phi(W)) A logp``, ``phi`` the Gamma weight of the sequence ratio ``W`` (``vespo_*`` knobs);
      - ``gmpo``: ``-exp(mean_t clip(log r_t)) A`` on every token of the row (``gmpo_policy_loss``), the mean over
        the tokens kept by ``entropy_mask``, which it applies there instead of multiplying it in.
    The policy term is multiplied by the off-policy mask (``off_policy_mask_threshold``: rows with ``A < 0`` whose
    mean ``base_logp - logp`` exceeds it get 0, ``base_logp`` = ``sampling_per_token_logps`` when given (a NaN
    difference counts as 0), else ``old_logp``), by ``entropy_mask`` (the high-entropy tokens,
    ``top_entropy_quantile``) and by ``rho``, the detached ``importance_sampling_ratio`` ``pi_old / pi_sampler``
    (``[B, T]`` per token or ``[B, 1]`` per row, from ``importance_sampling_ratio``), except for ``vespo``,
    where ``sum_t log rho`` (each ``log rho`` clamped to [log 1e-8, 20]) is added to ``log W`` instead, so ``W`` is
    ``pi / pi_sampler``. Then ``beta * k3_t`` is added on every token, ``k3_t = exp(ref - logp) - (ref - logp) - 1``
    (not multiplied by ``rho``), times ``r`` (with its gradient) when ``use_bias_correction_kl``. So per token:
    ``loss_t = policy_t * opm_i * entropy_mask_t * rho + beta * k3_t``, as TRL 1.16 (``vllm_importance_sampling_*``).

    Reduction over the ``[B, T]`` masked losses (``S`` = masked sum, ``n_i`` = tokens of row ``i``):
      - ``grpo``, ``sapo``, ``gmpo``: ``mean_i(sum_t loss / max(n_i, 1))`` (an empty row counts in the mean with 0, like TRL);
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
      - ``grpo`` / ``sapo`` / ``gmpo`` / ``dr_grpo`` / ``luspo``: return as is. With K micro-batches of equal size b, the
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
    if config is None:
        config = GRPOLossConfig(**knobs)
    elif knobs:
        raise TypeError(f"grpo_loss got both config and knobs {sorted(knobs)}; put them in the config.")
    entry = policy_loss(config.loss_type)
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
    ratio = torch.exp(log_importance_weights(log_ratio, mask, config.importance_sampling_level))
    rho = None
    if importance_sampling_ratio is not None:  # [B, T]: 1 on padding, so nothing there reaches a gradient or a sum
        rho = importance_sampling_ratio.detach().to(dtype)
        if rho.shape[1] != 1:
            rho = torch.where(mask, rho, torch.ones((), dtype=dtype, device=rho.device))
    policy, stats = entry.fn(PolicyInputs(logp, old, log_ratio, ratio, adv, mask, entropy_mask, rho), config)
    if config.off_policy_mask_threshold is not None:
        base = old if sampling_per_token_logps is None else masked(sampling_per_token_logps).detach()
        policy = policy * off_policy_mask(logp, base, mask, adv, config.off_policy_mask_threshold)
    if entropy_mask is not None and ENTROPY_MASK not in entry.applies:
        policy = policy * entropy_mask.to(dtype).detach()
    if rho is not None and IMPORTANCE_SAMPLING_RATIO not in entry.applies:
        policy = policy * rho
    per_token_loss = policy
    if beta > 0:
        ref_minus_logp = masked(ref_per_token_logps).detach() - logp
        kl = torch.exp(ref_minus_logp) - ref_minus_logp - 1
        if config.use_bias_correction_kl:
            kl = kl * ratio
        per_token_loss = per_token_loss + beta * kl
    per_token_loss = torch.where(mask, per_token_loss, zero)

    m = mask.to(dtype)
    loss = aggregation(entry.aggregation).fn(per_token_loss, m, max_completion_length=max_completion_length,
                                             num_items_in_batch=num_items_in_batch)

    if entropy_coef and entropies is not None:
        stats["policy_loss"] = loss.detach()
        selected = m if entropy_mask is None else m * entropy_mask.to(dtype).detach()
        summed = torch.where(mask, entropies.to(dtype), zero).mul(selected).sum()
        bonus = summed / selected.sum().clamp(min=1.0)
        stats["entropy_bonus"] = bonus.detach()
        loss = loss - entropy_coef * bonus / loss_scale

    if beta > 0:
        with torch.no_grad():
            stats["kl"] = (kl * m).sum() / m.sum().clamp(min=1.0)
    return loss, stats
