"""Reward shaping before the advantages: clipping, running normalisation (mean and variance of every reward seen so
far, checkpointed) and the penalty of a completion without EOS (``missing_eos_penalty``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import math

import torch

from lightalign.modules.losses.advantages.group import SCALE_REWARDS
from lightalign.knobs import KnobGroup, knob

@dataclasses.dataclass(frozen=True)
class MissingEOSKnobs(KnobGroup):
    """The penalty of a completion that ends without EOS (TRL's ``missing_eos_penalty``: PPO's and online DPO's)."""

    group = "missing_eos"
    missing_eos_penalty: float | None = knob(
        None, "subtracted from the reward (the score) of a completion without EOS, i.e. cut at "
              "``max_completion_length``; a number >= 0 (TRL: a positive value). None: no penalty.")

    def check(self) -> None:
        if self.missing_eos_penalty is not None and not self.missing_eos_penalty >= 0:
            raise ValueError(f"missing_eos_penalty must be a positive number subtracted from a reward, got "
                             f"{self.missing_eos_penalty}.")


def apply_missing_eos_penalty(rewards: torch.Tensor, has_eos: torch.Tensor, penalty: float | None) -> torch.Tensor:
    """``rewards`` with ``penalty`` subtracted where a completion has no EOS (TRL's ``missing_eos_penalty``)."""
    if penalty is None:
        return rewards
    return rewards - penalty * (~has_eos.bool()).to(rewards.dtype)


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


MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclasses.dataclass(frozen=True)
class RewardShapingKnobs(KnobGroup):
    """GRPO's way from rewards to advantages."""

    group = "reward_shaping"
    scale_rewards: Literal["group", "batch", "none"] | bool = knob(
        "group", "advantage scaling: ``group`` std, ``batch`` std, or ``none``; TRL's former booleans are read as "
                 "``true`` = ``group``, ``false`` = ``none``.")
    normalize_rewards: bool = knob(False, "normalise rewards by their running mean/std before the advantages "
                                          "(statistics of the whole generation batch, every rank's, so all ranks keep "
                                          "the same ones).")
    reward_clip: float | None = knob(None, "clip (normalised) rewards to ``[-reward_clip, reward_clip]``.")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = knob(
        "sum_then_normalize", "``sum_then_normalize`` (default): weighted sum of the rewards, then ``scale_rewards``; "
                              "``normalize_then_sum`` (GDPO): each function's rewards are normalised within each group "
                              "(``(r - mean) / (std + 1e-4)``), weighted and summed, and the sum is normalised over the "
                              "whole generation batch (every rank's); ``scale_rewards`` is then not used, and "
                              "``normalize_rewards`` / ``reward_clip`` (lightalign's, on the summed reward) are refused "
                              "with it.")

    def __post_init__(self) -> None:
        if isinstance(self.scale_rewards, bool):  # TRL's former type: True = "group", False = "none"
            object.__setattr__(self, "scale_rewards", "group" if self.scale_rewards else "none")
        super().__post_init__()

    def check(self) -> None:
        check_reward_shaping(self.scale_rewards, self.normalize_rewards, self.reward_clip,
                             self.multi_objective_aggregation)


def check_reward_shaping(scale_rewards: str, normalize_rewards: bool, reward_clip: float | None,
                         multi_objective_aggregation: str) -> None:
    """GRPO's reward-to-advantage knobs, checked at construction."""
    if multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation={multi_objective_aggregation!r} is unknown; use one of "
                         f"{list(MULTI_OBJECTIVE_AGGREGATIONS)}.")
    if multi_objective_aggregation == "normalize_then_sum" and (
            normalize_rewards or reward_clip is not None or scale_rewards == "none"):
        raise ValueError("multi_objective_aggregation='normalize_then_sum' normalises each reward function per "
                         "group and the weighted sum over the batch itself: unset normalize_rewards and "
                         "reward_clip, and leave scale_rewards at 'group' (it is not used; 'none' would be "
                         "silently ignored).")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards='{scale_rewards}' is unknown; use one of {list(SCALE_REWARDS)}.")
    if reward_clip is not None and reward_clip <= 0:
        raise ValueError(f"reward_clip must be a positive number or null, got {reward_clip}.")
