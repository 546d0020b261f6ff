"""Reward shaping before the advantages: clipping and running normalisation (mean and variance of every reward
seen so far, checkpointed)."""

from __future__ import annotations

import math

import torch

def clip_rewards(rewards: torch.Tensor, reward_clip: float | None) -> torch.Tensor:
    """Clamp rewards to ``[-reward_clip, reward_clip]``; None leaves them unchanged (NaN stays NaN). ``reward_clip``
    is checked (> 0) where it is configured."""
    if reward_clip is None:
        return rewards
    return rewards.clamp(-float(reward_clip), float(reward_clip))


class RunningRewardNormalizer:
    """Running mean and variance of every reward seen so far (Chan et al.'s parallel merge of Welford moments).

    ``normalize(rewards)`` first adds the batch to the statistics, then returns ``(rewards - mean) / sqrt(var + eps)``
    with the population variance (``numpy.var``). NaN rewards are skipped in the statistics and stay NaN. Under data
    parallelism, pass every rank's rewards as ``pool`` so that every rank keeps the same statistics.
    """

    def __init__(self, eps: float = 1e-8):
        self.eps = float(eps)
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    @property
    def var(self) -> float:
        # 1.0 before any reward has been seen, so that normalizing is then only centring.
        return self.m2 / self.count if self.count else 1.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, rewards: torch.Tensor) -> None:
        values = rewards.detach().double().flatten()
        values = values[~torch.isnan(values)]
        n = values.numel()
        if n == 0:
            return
        batch_mean = values.mean().item()
        batch_m2 = ((values - batch_mean) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    def normalize(self, rewards: torch.Tensor, pool: torch.Tensor | None = None) -> torch.Tensor:
        """Add ``pool`` (default ``rewards``; under data parallelism every rank's rewards, so that all ranks keep
        the same statistics) to the statistics, then normalise ``rewards``."""
        self.update(rewards if pool is None else pool)
        dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
        return ((rewards.double() - self.mean) / math.sqrt(self.var + self.eps)).to(dtype)

    __call__ = normalize

    def state_dict(self) -> dict[str, float]:
        return {"count": float(self.count), "mean": self.mean, "m2": self.m2, "eps": self.eps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count = int(state["count"])
        self.mean, self.m2 = float(state["mean"]), float(state["m2"])
        self.eps = float(state.get("eps", self.eps))
