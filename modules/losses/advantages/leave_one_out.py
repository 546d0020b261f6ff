"""REINFORCE Leave-One-Out advantages (RLOO, Ahmadian et al. 2024; TRL 1.16's ``RLOOTrainer``).

Rewards are laid out as GRPO lays them out: rows ``i*G .. i*G+G-1`` are the ``G = num_generations`` completions of
prompt ``i``; a NaN reward marks a completion no reward function could score. The KL penalty goes into the reward,
per sequence (``kl_penalized_rewards``); the baseline of a completion is the mean reward of the *other* scorable
completions of its prompt (``rloo_advantages``).
"""

from __future__ import annotations

from typing import Callable

import torch

from lightalign.modules.losses.advantages.group import nanstd
from lightalign.modules.losses.registry import register_advantage_estimator

def kl_penalized_rewards(rewards: torch.Tensor, old_per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor,
                         completion_mask: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rewards - beta * kl, kl)`` with ``kl = sum_t (old_t - ref_t)`` over each completion's tokens ``[N]``."""
    kl = ((old_per_token_logps - ref_per_token_logps) * completion_mask).sum(-1)
    return rewards - beta * kl, kl


@register_advantage_estimator("rloo")
def rloo_advantages(rewards: torch.Tensor, num_generations: int, normalize: bool = False,
                    gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Leave-one-out advantages ``[N]`` of rewards ``[N]`` (NaN = unscorable).

    ``gather``: under data parallelism, maps this rank's advantages to every rank's (concatenated), so that
    ``normalize`` standardises over the whole generation batch as TRL does; None uses this rank's own.
    """
    if rewards.dim() != 1 or num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"rloo_advantages needs 1-D rewards holding whole groups of num_generations="
                         f"{num_generations}; got shape {tuple(rewards.shape)}.")
    if num_generations == 1:
        advantages = torch.zeros_like(rewards)
    else:
        grouped = rewards.view(-1, num_generations)
        scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
        others = torch.nansum(grouped, dim=1, keepdim=True) - grouped  # NaN stays NaN for unscorable rows
        baselines = others / (scorable - 1)  # 0/0 -> NaN for a group with a single scorable completion
        advantages = (grouped - baselines).view(-1)
    if normalize:  # over the scorable completions (NaN still marks the others)
        pool = advantages if gather is None else gather(advantages)
        advantages = (advantages - torch.nanmean(pool)) / (nanstd(pool) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)
