"""GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673; TRL 1.16's ``trl.experimental.gmpo``): the policy
loss ``gmpo``, selected by ``loss_type: gmpo``."""

from __future__ import annotations

import torch

from lightalign.modules.losses.grpo_surrogates import clip_fractions, token_level_only, upper_epsilon
from lightalign.modules.losses.registry import ENTROPY_MASK, PolicyInputs, register_policy_loss


@register_policy_loss("gmpo", aggregation="sequence_mean", applies=(ENTROPY_MASK,), check=token_level_only("gmpo"))
def gmpo_policy_loss(x: PolicyInputs, config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``-exp(mean_t clip(log r_t)) A`` per completion: the geometric mean of its token ratios, each clipped in
    log space to ``[-epsilon, epsilon_high]`` on the side that would grow the objective (PPO's pessimistic
    ``min``: ``log r <= epsilon_high`` where ``A > 0``, ``log r >= -epsilon`` otherwise).

    The geometric mean is far less moved by one outlier ratio than the arithmetic mean of GRPO, which is why the
    range can be wider (the paper and TRL's ``GMPOConfig`` use ``epsilon = 0.4``, i.e. ratios in
    ``(exp(-0.4), exp(0.4))``; here ``epsilon`` keeps GRPO's default 0.2, so set it). The mean runs over the
    completion's tokens kept by ``entropy_mask`` (``top_entropy_quantile``), which is why this loss applies that
    mask itself. The term is the same on every real token of the row, so the ``sequence_mean`` aggregation gives
    ``mean_i(-W_i A_i)`` plus, with ``beta``, each row's token mean of ``beta * k3``, as TRL 1.16's
    ``GMPOTrainer``. Unlike TRL, a completion without real tokens contributes 0, not ``-A_i`` (no gradient
    either way), and ``use_bias_correction_kl`` (TRL ignores it for GMPO) weights ``k3`` by the token ratio.
    Statistics: the fractions of tokens whose log-ratio lies beyond the clip range on the clipped side."""
    eps_high = upper_epsilon(config)
    positive = x.adv > 0
    clipped = torch.where(positive, x.log_ratio.clamp(max=eps_high), x.log_ratio.clamp(min=-config.epsilon))
    kept = (x.mask if x.entropy_mask is None else x.mask & x.entropy_mask.bool()).to(clipped.dtype)
    log_weight = (clipped * kept).sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp(min=1.0)
    policy = (-torch.exp(log_weight) * x.adv).expand_as(x.logp)
    with torch.no_grad():
        low = (x.log_ratio < -config.epsilon) & (x.adv < 0) & x.mask
        high = (x.log_ratio > eps_high) & positive & x.mask
    return policy, clip_fractions(low, high, x.mask, x.log_ratio.dtype)
