"""GRPOModule.score and the rollout: rewards -> (normalised, clipped) -> advantages, inside the module."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest
import torch
from torchmetrics.aggregation import MeanMetric


def column_reward(prompts, completions, value, **kwargs):
    """The reward is the row's ``value`` column: the test decides every reward."""
    return [float(v) for v in value]


def _rollout(values, truncated=None):
    n = len(values)
    return {"prompts": ["p"] * n, "completions": ["c"] * n, "texts": ["c"] * n,
            "columns": {"value": list(values)}, "completion_mask": torch.ones(n, 3, dtype=torch.long),
            "truncated": torch.zeros(n, dtype=torch.bool) if truncated is None else torch.tensor(truncated)}


class _Stats(dict):
    """Any metric name -> a MeanMetric (score() logs several)."""

    def __missing__(self, key):
        self[key] = MeanMetric()
        return self[key]


def test_score_under_ddp_scales_by_the_std_of_every_ranks_rewards(grpo_module):
    module = grpo_module(reward_funcs=[column_reward], scale_rewards="batch")
    mine, other_rank = [1.0, 0.0, 0.0, 1.0], [10.0, 20.0, 30.0, 40.0]
    module._trainer = SimpleNamespace(world_size=2, global_step=0)  # as on rank 0 of 2
    module.all_gather = lambda tensor: torch.stack([tensor, torch.tensor(other_rank)])
    advantages = module.score(_rollout(mine), _Stats())
    std = statistics.stdev(mine + other_rank)
    assert advantages.tolist() == pytest.approx([(r - 0.5) / (std + 1e-4) for r in mine], rel=1e-5)
