"""GRPO's per-token policy terms, one pure function per idea: importance weights (token or sequence level), the
clipped surrogate (with ``delta``), CISPO, SAPO, VESPO's Gamma weights, and the off-policy sequence mask; and TRL's
loss types built from them, registered as policy losses (``register_policy_loss``) with the aggregation each is
normalised by.

All take ``[B, T]`` tensors whose padding is already zeroed (``grpo_loss`` does that) and the advantages as
``[B, 1]``; formulas follow TRL's ``GRPOTrainer._compute_loss`` (TRL 1.x), written here from the papers' equations.
"""

from __future__ import annotations

import math

import torch

import lightalign.modules.losses.aggregations  # noqa: F401  (registers the aggregations the losses name)
from lightalign.modules.losses.registry import IMPORTANCE_SAMPLING_RATIO, PolicyInputs, register_policy_loss

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def log_importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``log(pi / pi_old)`` per token (``token``), or each row's mean over its real tokens broadcast to every token
    (``sequence``, GSPO). ``log_ratio`` is 0 under the mask; the result is ``[B, T]`` in both cases."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        m = mask.to(log_ratio.dtype)
        mean = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        return mean.expand_as(log_ratio)
    raise ValueError(f"importance_sampling_level={level!r} is unknown; use one of {list(IMPORTANCE_SAMPLING_LEVELS)}.")


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, epsilon: float, epsilon_high: float,
                      delta: float | None = None) -> torch.Tensor:
    """PPO's ``-min(r A, clamp(r, 1 - epsilon, 1 + epsilon_high) A)``; with ``delta`` the unclipped branch uses
    ``min(r, delta)`` (two-sided clipping, INTELLECT-2): a negative advantage can no longer push an already
    unlikely-under-pi_old token's ratio up without bound."""
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    return -torch.minimum(unclipped * adv, clipped * adv)


def cispo_surrogate(ratio: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, epsilon_high: float) -> torch.Tensor:
    """CISPO (MiniMax-M1): ``-sg(min(r, epsilon_high)) A log pi``; the importance weight is capped (at
    ``epsilon_high`` itself, not ``1 + epsilon_high``) and detached, so every token keeps a gradient."""
    return -torch.clamp(ratio, max=epsilon_high).detach() * adv * logp


def sapo_surrogate(ratio: torch.Tensor, adv: torch.Tensor, temperature_pos: float,
                   temperature_neg: float) -> torch.Tensor:
    """SAPO: ``-(4 / tau) sigmoid(tau (r - 1)) A`` with ``tau = temperature_pos`` where ``A > 0``, else
    ``temperature_neg``. Its gradient is ``-4 s (1 - s) r A grad log pi`` (``s`` the sigmoid), the plain policy
    gradient at ``r = 1`` and a smooth decay away from it instead of a hard cut."""
    tau = torch.where(adv > 0, torch.full_like(adv, temperature_pos), torch.full_like(adv, temperature_neg))
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv


@torch.no_grad()
def vespo_weights(log_ratio: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, k_pos: float, lambda_pos: float,
                  k_neg: float, lambda_neg: float, importance_sampling_ratio: torch.Tensor | None = None,
                  ) -> torch.Tensor:
    """VESPO's Gamma weight per row ``[B, 1]`` (detached): ``phi(w) = exp(lambda) w^k exp(-lambda w)`` (so
    ``phi(1) = 1``), ``w`` the sequence ratio ``exp(sum_t log r_t)`` (each ``log r_t`` clamped to [-20, 20], the
    sum to [log 1e-8, 20]); ``k, lambda`` are the ``_pos`` pair where ``A >= 0``, else ``_neg``.

    ``importance_sampling_ratio`` (``pi_old / pi_sampler``, ``[B, T]`` holding 1 on padding, or ``[B, 1]``): its
    log, clamped to [log 1e-8, 20] per entry (so a masked-out 0 counts as log 1e-8), is summed per row into the
    sequence log-ratio before the clamp, making ``w`` the ratio ``pi / pi_sampler`` (TRL's ``get_gamma_weights``)."""
    seq = (torch.clamp(log_ratio, -20.0, 20.0) * mask.to(log_ratio.dtype)).sum(-1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_is = torch.clamp(torch.log(importance_sampling_ratio), math.log(1e-8), 20.0)
        seq = seq + log_is.sum(-1, keepdim=True)
    log_w = torch.clamp(seq, math.log(1e-8), 20.0)
    nonneg = adv >= 0
    k = torch.where(nonneg, torch.full_like(adv, k_pos), torch.full_like(adv, k_neg))
    lam = torch.where(nonneg, torch.full_like(adv, lambda_pos), torch.full_like(adv, lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def off_policy_mask(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask ``[B, 1]``: 0 for a row with ``A < 0`` whose mean per-token
    ``log pi_old - log pi`` exceeds ``threshold``, 1 otherwise. ``old_logp`` may be the sampler's log-probs
    (``grpo_loss``'s ``sampling_per_token_logps``): a token whose difference is NaN (the sampler could not score it)
    counts as 0, so one unscorable token cannot drop its row."""
    m = mask.to(logp.dtype)
    per_token = torch.nan_to_num(old_logp - logp, nan=0.0)
    kl = (per_token * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (kl <= threshold)).to(logp.dtype)


# ------------------------------------------------------------------------------------------------ registered losses
def upper_epsilon(config) -> float:
    """``epsilon_high``, or ``epsilon`` when it is unset (both sides the same)."""
    return config.epsilon if config.epsilon_high is None else config.epsilon_high


@torch.no_grad()
def clip_fractions(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``clip_ratio/{low,high,region}_mean``: the fractions of this micro-batch's real tokens clipped below, above,
    either (``low``/``high`` boolean ``[B, T]``, already restricted to ``mask``), in ``dtype``."""
    n = mask.to(dtype).sum().clamp(min=1.0)
    return {"clip_ratio/low_mean": low.to(dtype).sum() / n, "clip_ratio/high_mean": high.to(dtype).sum() / n,
            "clip_ratio/region_mean": (low | high).to(dtype).sum() / n}


def _needs_sequence_level(config) -> None:
    if config.importance_sampling_level != "sequence":
        raise ValueError("loss_type 'luspo' scales each sequence's loss by its length and needs "
                         "importance_sampling_level='sequence' (TRL only warns, and then sums each completion's "
                         "token-level ratio losses instead).")


def _needs_upper_cap(config) -> None:
    if config.epsilon_high is None:
        raise ValueError("loss_type 'cispo' caps the importance ratio at epsilon_high itself (not 1 + epsilon_high); "
                         "set epsilon_high explicitly (ScaleRL recommends 5.0). TRL falls back to epsilon (0.2), "
                         "which would scale every token's gradient by 0.2.")


def token_level_only(loss_type: str):
    """A check refusing ``importance_sampling_level='sequence'`` for a loss that builds its own sequence weight."""

    def check(config) -> None:
        if config.importance_sampling_level != "token":
            raise ValueError(f"loss_type '{loss_type}' builds its own sequence-level weight from the token "
                             "log-ratios; leave importance_sampling_level='token'.")

    return check


def clipped_policy_loss(x: PolicyInputs, config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (``clipped_surrogate``, with ``delta``), for TRL's ``grpo``, ``bnpo``, ``dr_grpo``,
    ``dapo`` and ``luspo``, which differ only in their aggregation (``luspo`` also needs sequence-level ratios)."""
    eps_high = upper_epsilon(config)
    policy = clipped_surrogate(x.ratio, x.adv, config.epsilon, eps_high, config.delta)
    with torch.no_grad():
        capped = x.ratio if config.delta is None else torch.clamp(x.ratio, max=config.delta)
        low = (capped < 1 - config.epsilon) & (x.adv < 0) & x.mask
        high = (capped > 1 + eps_high) & (x.adv > 0) & x.mask
    return policy, clip_fractions(low, high, x.mask, x.ratio.dtype)


for _name, _aggregation in (("grpo", "sequence_mean"), ("bnpo", "token_mean"), ("dr_grpo", "max_length"),
                            ("dapo", "step_token_mean")):
    register_policy_loss(_name, aggregation=_aggregation, reads_delta=True)(clipped_policy_loss)


@register_policy_loss("cispo", aggregation="step_token_mean", check=_needs_upper_cap)
def cispo_policy_loss(x: PolicyInputs, config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (``cispo_surrogate``): the ratio capped at ``epsilon_high`` and detached."""
    policy = cispo_surrogate(x.ratio, x.logp, x.adv, config.epsilon_high)
    with torch.no_grad():
        high = (x.ratio > config.epsilon_high) & (x.adv > 0) & x.mask
    return policy, clip_fractions(torch.zeros_like(x.mask), high, x.mask, x.ratio.dtype)


@register_policy_loss("sapo", aggregation="sequence_mean")
def sapo_policy_loss(x: PolicyInputs, config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (``sapo_surrogate``): a smooth sigmoid gate instead of a hard clip; no clip statistics."""
    return sapo_surrogate(x.ratio, x.adv, config.sapo_temperature_pos, config.sapo_temperature_neg), {}


register_policy_loss("luspo", aggregation="sequence_sum", reads_delta=True,
                     check=_needs_sequence_level)(clipped_policy_loss)


@register_policy_loss("vespo", aggregation="step_token_mean", applies=(IMPORTANCE_SAMPLING_RATIO,),
                      check=token_level_only("vespo"))
def vespo_policy_loss(x: PolicyInputs, config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO: ``-sg(phi(W)) A logp`` with ``phi`` the Gamma weight of the sequence ratio (``vespo_weights``), into
    which the sampler correction ``rho`` enters as ``sum_t log rho`` (so it is not multiplied in afterwards)."""
    phi = vespo_weights(x.log_ratio, x.mask, x.adv, config.vespo_k_pos, config.vespo_lambda_pos, config.vespo_k_neg,
                        config.vespo_lambda_neg, x.rho)
    return -phi * x.adv * x.logp, {"vespo/phi_seq_mean": phi.mean()}
