"""Group-relative advantages (GRPO's ``scale_rewards``, GDPO's ``normalize_then_sum``) and their statistics.

Rewards are laid out as TRL lays them out: rows ``i*G .. i*G+G-1`` are the ``G = num_generations`` completions of
prompt ``i``. A NaN reward marks an unscorable completion (every reward function returned None): it is left out of
the baselines and its advantage is 0, as in TRL.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from lightalign.modules.losses.registry import register_advantage_estimator

SCALE_REWARDS = ("group", "batch", "none")


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased (Bessel-corrected) standard deviation ignoring NaNs; NaN where fewer than 2 values (as TRL's)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    sq = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.full_like(sq, float("nan")))
    std = var.sqrt()
    if keepdim:
        return std
    return std.reshape(()) if dim is None else std.squeeze(dim)


def _check_scale_rewards(scale_rewards: str | bool) -> str:
    # TRL's config also accepts True ("group") and False ("none").
    value = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)  # type: ignore[arg-type]
    if value not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not valid; use one of {list(SCALE_REWARDS)}.")
    return value


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [N], got shape {tuple(rewards.shape)}.")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"{rewards.numel()} rewards cannot be split into groups of num_generations={num_generations}; "
            "the batch must hold whole groups (N = prompts * num_generations)."
        )
    return rewards.view(-1, num_generations)


def _reward_std(rewards: torch.Tensor, num_generations: int, scale_rewards: str,
                batch_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row std used for scaling: the group's (also for "none", for logging) or the batch's (``batch_rewards``,
    the whole generation batch, when given; else ``rewards``)."""
    grouped = _grouped(rewards, num_generations)
    if scale_rewards == "batch":
        batch = rewards if batch_rewards is None else batch_rewards.float().flatten()
        return nanstd(batch).expand_as(rewards) if batch.numel() > 1 else torch.zeros_like(rewards)
    if num_generations == 1:
        return torch.zeros_like(rewards)
    return nanstd(grouped, dim=1).repeat_interleave(num_generations)


@register_advantage_estimator("grpo")
def scale_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str | bool = "group",
                     batch_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO advantages: ``reward - group mean``, divided by ``std + 1e-4`` unless ``scale_rewards="none"``.

    ``"group"`` divides by each group's std, ``"batch"`` by the std over the whole generation batch (both
    unbiased, as TRL), ``"none"`` does not divide (Dr. GRPO). A group of equal rewards gets advantages 0. NaN
    rewards are ignored by the means and stds and get advantage 0.

    ``batch_rewards``: for ``"batch"`` under data parallelism, the rewards of every rank's completions (this
    rank's included, e.g. an all-gather), so each rank divides by the global batch's std as TRL does; without it
    the batch is ``rewards``. Groups never straddle ranks, so the group means stay local.
    """
    scale_rewards = _check_scale_rewards(scale_rewards)
    rewards = rewards.float()
    mean = torch.nanmean(_grouped(rewards, num_generations), dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (_reward_std(rewards, num_generations, scale_rewards, batch_rewards) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@register_advantage_estimator("gdpo")
def normalize_then_sum(per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                       gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """GDPO's advantages (TRL's ``multi_objective_aggregation="normalize_then_sum"``) from ``per_func [N, F]``
    (NaN where a function returned None): each function's rewards become ``(r - group mean) / (group std + 1e-4)``,
    the weighted nansum over functions is the reward (NaN if every function returned None), and the advantage is
    ``(reward - batch mean) / (batch std + 1e-4)`` (unbiased stds; 0 for NaN rewards).

    ``gather``: under data parallelism, maps this rank's rewards to every rank's (e.g. an all-gather), so the batch
    statistics are the whole generation batch's, as TRL's; groups never straddle ranks."""
    if per_func.dim() != 2 or weights.shape != per_func.shape[1:]:
        raise ValueError(f"per_func must be [N, F] with one weight per function; got {tuple(per_func.shape)} and "
                         f"{tuple(weights.shape)} weights.")
    per_func = per_func.float()
    _grouped(per_func[:, 0], num_generations)  # whole groups, or a clear error
    grouped = per_func.view(-1, num_generations, per_func.shape[1])
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean)
    normalized = ((grouped - mean) / (std + 1e-4)).view_as(per_func)
    rewards = (normalized * weights.float().unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = math.nan
    batch = rewards if gather is None else gather(rewards)
    std_batch = nanstd(batch) if batch.numel() > 1 else torch.zeros((), device=rewards.device)
    return torch.nan_to_num((rewards - torch.nanmean(batch)) / (std_batch + 1e-4), nan=0.0)


def zero_std_fraction(rewards: torch.Tensor, num_generations: int) -> float:
    """The fraction of groups whose rewards are all equal (no learning signal); TRL logs it as frac_reward_zero_std."""
    std = _reward_std(rewards.float(), num_generations, "group").view(-1, num_generations)[:, 0]
    return torch.isclose(torch.nan_to_num(std, nan=0.0), torch.zeros_like(std)).float().mean().item()
