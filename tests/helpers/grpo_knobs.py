"""``check_grpo_knobs``: GRPO's loss-related knobs checked by the components that own them, as ``GRPOModule``
checks them at construction (the loss group ``GRPOLossConfig``, the KL coefficient, the entropy knobs) plus the
``dr_grpo`` aggregation's need for ``max_completion_length``."""

from __future__ import annotations

import torch

from lightalign.modules.sampling.config import SamplingKnobs
from lightalign.modules.losses.entropy import EntropyKnobs
from lightalign.modules.losses.grpo import GRPOLossConfig, grpo_loss
from lightalign.modules.losses.kl_penalty import KLKnobs


def check_grpo_knobs(loss_type: str, epsilon: float, epsilon_high: float | None, beta: float,
                     max_completion_length: int | None, *, top_entropy_quantile: float = 1.0,
                     entropy_coef: float = 0.0, **knobs) -> None:
    """Raise the ``ValueError`` a wrong value among these knobs gets."""
    config = GRPOLossConfig(loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high, **knobs)
    KLKnobs(beta=beta)
    if max_completion_length is not None:  # the sampling limit's own check
        SamplingKnobs(max_completion_length=max_completion_length)
    EntropyKnobs(entropy_coef=entropy_coef, top_entropy_quantile=top_entropy_quantile)
    if loss_type == "dr_grpo":  # the aggregation reads the sampling limit
        ones = torch.zeros(1, 2, requires_grad=True)
        grpo_loss(ones, None, torch.ones(1), torch.ones(1, 2), config=config, max_completion_length=max_completion_length)
