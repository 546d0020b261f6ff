"""A*-PO's regression loss (optimal advantage regression, Brantley et al. 2025), a pure function of tensors.

Each completion ``y`` of prompt ``x`` (one per prompt, sampled by the policy) has a reward ``r`` and the prompt's
optimal value ``V*(x)``, estimated before training from reference samples (``optimal_values``). The policy's implicit
reward ``beta2 * log(pi(y|x) / pi_ref(y|x))`` (sequence log-probabilities: the per-token log-ratios summed over the
completion's tokens) is regressed onto the optimal advantage ``r - V*(x)`` by squared error, averaged over the
completions. The formula is TRL 1.16's ``A2POTrainer.compute_loss`` (checked against its source).
"""

from __future__ import annotations

import dataclasses

import torch

from lightalign.knobs import KnobGroup, knob

__all__ = ["A2POLossConfig", "a2po_loss"]


@dataclasses.dataclass(frozen=True)
class A2POLossConfig(KnobGroup):
    """The temperature of A*-PO's regression (TRL 1.16's ``beta2``)."""

    group = "a2po_loss"
    beta2: float = knob(1e-3, "the KL temperature of the regression target: the implicit reward "
                              "``beta2 * log(pi / pi_ref)`` is regressed onto ``r - V*``; > 0.")

    def check(self) -> None:
        if not self.beta2 > 0:
            raise ValueError(f"beta2 must be > 0 (the implicit reward beta2 * log(pi / pi_ref) is what is regressed "
                             f"onto r - V*; TRL's default is 1e-3), got {self.beta2}.")


def a2po_loss(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor, completion_mask: torch.Tensor,
              rewards: torch.Tensor, optimal_values: torch.Tensor, config: A2POLossConfig,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``mean_i (beta2 * (sum_t logp_it - sum_t logp_ref_it) - (r_i - V*_i))^2``.

    ``per_token_logps``/``ref_per_token_logps``/``completion_mask``: ``[N, T]`` (the policy's with gradient, the
    reference's without); ``rewards`` and ``optimal_values``: ``[N]``. Returns the loss and TRL's statistics: the
    mean ``implicit_reward`` and the mean ``advantage`` (the regression target ``r - V*``)."""
    mask = completion_mask.to(per_token_logps.dtype)
    policy = (per_token_logps * mask).sum(-1)
    ref = (ref_per_token_logps.detach() * mask).sum(-1)
    implicit_reward = config.beta2 * (policy - ref)
    target = rewards.to(implicit_reward.dtype) - optimal_values.to(implicit_reward.dtype)
    loss = ((implicit_reward - target) ** 2).mean()
    stats = {"implicit_reward": implicit_reward.detach().mean(), "advantage": target.detach().mean()}
    return loss, stats
