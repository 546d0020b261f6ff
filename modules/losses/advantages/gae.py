"""Per-token advantages of a policy with a value head (PPO): per-token rewards with the KL penalty
(``token_rewards``), generalised advantage estimation (``gae``) and whitening (``whiten``) with its masked
statistics, as TRL's PPO trainers compute them (the sources are listed with PPO's losses, ``clipped_policy_loss``).

Tensors are ``[B, T]`` over the completion tokens with a 0/1 ``mask`` (1 on the completion through its EOS).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from lightalign.knobs import KnobGroup, knob
from lightalign.modules.losses.registry import register_advantage_estimator


@dataclasses.dataclass(frozen=True)
class GAEKnobs(KnobGroup):
    """Generalised advantage estimation (``gae``) and the whitening of the per-token rewards before it."""

    group = "gae"
    gamma: float = knob(1.0, "GAE's discount.")
    lam: float = knob(0.95, "GAE's lambda.")
    whiten_rewards: bool = knob(False, "whiten the per-token rewards (scale only) before GAE.")

    def check(self) -> None:
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1] (GAE's discount), got {self.gamma}.")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"lam must be in [0, 1] (GAE's lambda), got {self.lam}.")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` where ``mask`` is 1 (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased (Bessel-corrected) variance of ``x`` where ``mask`` is 1, as TRL's ``masked_var``; needs two tokens."""
    count = mask.sum()
    if count < 2:
        raise ValueError(f"Whitening needs at least 2 tokens under the mask, got {int(count)}: use a larger "
                         "generation_batch_size (or longer completions).")
    centred = (x - masked_mean(x, mask)) * mask.to(x.dtype)
    return (centred ** 2).sum() / (count - 1)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
           sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` over the masked entries (unbiased variance); ``shift_mean=False`` adds the
    mean back (only the scale changes). Entries outside the mask are transformed too: mask them afterwards.

    ``sum_over_ranks`` (a sum over every process, e.g. an all-reduce) makes the mean and variance those of every
    rank's entries together, as one process holding the whole rollout would compute them (two passes, like the
    local ones)."""
    if sum_over_ranks is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    else:
        m = mask.to(x.dtype)
        total = sum_over_ranks(torch.stack([(x * m).sum(), m.sum()]))
        count = total[1]
        if count < 2:
            raise ValueError(f"Whitening needs at least 2 tokens under the mask, got {int(count)}: use a larger "
                             "generation_batch_size (or longer completions).")
        mean = total[0] / count
        var = sum_over_ranks((((x - mean) * m) ** 2).sum()) / (count - 1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return out if shift_mean else out + mean


def token_rewards(scores: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor | None, mask: torch.Tensor,
                  kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``[B, T]``: ``-kl_coef * (logp - ref_logp)`` on every completion token, plus the score of
    the completion at its last token; and the per-token KL ``logp - ref_logp`` (k1, 0 off the mask). A row with an
    empty mask gets nothing (its score is dropped)."""
    mask_f = mask.to(logps.dtype)
    kl = torch.zeros_like(logps) if ref_logps is None else (logps - ref_logps) * mask_f
    rewards = -kl_coef * kl
    last = (mask.long().sum(-1) - 1).clamp(min=0)
    rows = torch.arange(scores.shape[0], device=scores.device)
    rewards[rows, last] += scores.to(rewards.dtype) * mask_f[rows, last]
    return rewards, kl


@register_advantage_estimator("gae")
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, right to left over the completion tokens:
    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``, where ``V_{t+1}`` and
    ``A_{t+1}`` are 0 past the last masked token (the episode ends there). Returns ``(advantages, returns)`` with
    ``returns = advantages + values``, both 0 off the mask."""
    mask_f = mask.to(values.dtype)
    values = values * mask_f
    rewards = rewards * mask_f
    length = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_adv = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = (delta + gamma * lam * next_adv) * mask_f[:, t]
        advantages[:, t] = next_adv
        next_value = values[:, t]
    return advantages, (advantages + values) * mask_f
