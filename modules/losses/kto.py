"""KTO's loss and its KL estimate as pure functions of per-sequence log-probs (no model, no data).

Facts from TRL 1.16's ``KTOTrainer`` (read in the 1.16.0 wheel) and the KTO paper (arXiv 2402.01306, Eq. 7-8):

* the log-ratio of a completion is ``r = log pi(y|x) - log pi_ref(y|x)`` (summed over the completion tokens);
* ``kto``: desirable rows lose ``w_d * (1 - sigmoid(beta * (r - z)))``, undesirable rows
  ``w_u * (1 - sigmoid(beta * (z - r)))``, where ``z`` is the KL estimate;
* ``apo_zero_unpaired`` (APO-zero, unpaired): desirable ``w_d * (1 - sigmoid(beta * r))``, undesirable
  ``w_u * sigmoid(beta * r)``; no KL term;
* ``z`` is the mean log-ratio of the *mismatched* sequences of the micro-batch (each prompt with another row's
  completion), averaged over the ranks, clamped at 0 and detached: no gradient flows through it;
* the loss of a micro-batch is the mean over its rows of the weighted row losses (the weights are not
  renormalised); the reward of a row is ``beta * r`` (detached).
"""

from __future__ import annotations

import dataclasses

import torch

from lightalign.knobs import KnobGroup, knob
from lightalign.modules.losses.implicit_reward import ImplicitRewardKnobs

LOSS_TYPES = ("kto", "apo_zero_unpaired")


@dataclasses.dataclass(frozen=True)
class KTOLossConfig(KnobGroup):
    """KTO's loss knobs (TRL's names), checked once here, at construction; its temperature ``beta`` is
    ``ImplicitRewardKnobs``' (DPO's too)."""

    group = "loss"
    loss_type: str = knob(
        "kto", "``kto`` (default) or ``apo_zero_unpaired`` (APO-zero on unpaired rows: no KL term, so no mismatched "
               "forwards).")
    desirable_weight: float = knob(1.0, "weight of the desirable rows' losses (> 0, default 1.0).")
    undesirable_weight: float = knob(
        1.0, "weight of the undesirable rows' losses (> 0, default 1.0). With unequal counts, TRL's recommended range "
             "(KTO paper, Eq. 8) is checked at fit start and a warning says which values fit.")

    def check(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type='{self.loss_type}' is unknown for KTO; use one of {list(LOSS_TYPES)}.")
        for name, value in (("desirable_weight", self.desirable_weight),
                            ("undesirable_weight", self.undesirable_weight)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 (1.0 weighs both kinds of rows equally), got {value}.")


def validate_kto_config(loss_type: str, beta: float, desirable_weight: float, undesirable_weight: float) -> None:
    """Refuse knobs KTO cannot use, naming the knob: the checks of ``KTOLossConfig`` and ``ImplicitRewardKnobs``."""
    KTOLossConfig(loss_type=loss_type, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    ImplicitRewardKnobs(beta=beta)


def kl_estimate(kl_policy_logps: torch.Tensor, kl_ref_logps: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the KL estimate: the mean log-ratio of its mismatched sequences (detached).
    Average it over the ranks, then ``clamp(min=0)`` (``KTOModule`` does both)."""
    return (kl_policy_logps.detach().float() - kl_ref_logps.detach().float()).mean()


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    labels: torch.Tensor,
    kl: torch.Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO over one micro-batch of rows.

    Args:
        policy_logps: ``[N]`` summed completion log-probs under the policy.
        ref_logps: ``[N]`` the same under the reference.
        labels: ``[N]`` bool, True for desirable rows.
        kl: the KL estimate ``z`` (a scalar, already clamped at 0; ignored by ``apo_zero_unpaired``). It is
            detached here whatever is passed.
        beta, desirable_weight, undesirable_weight, loss_type: TRL's knobs.

    Returns:
        ``(loss, stats)``: the mean of the weighted row losses, and per-row detached ``losses`` ``[N]`` (weighted)
        and ``rewards`` ``[N]`` (``beta * r``).
    """
    labels = labels.to(torch.bool)
    logratios = policy_logps.float() - ref_logps.float()
    kl = torch.as_tensor(kl, dtype=torch.float32, device=logratios.device).detach()
    if loss_type == "kto":
        desirable = 1.0 - torch.sigmoid(beta * (logratios - kl))
        undesirable = 1.0 - torch.sigmoid(beta * (kl - logratios))
    elif loss_type == "apo_zero_unpaired":
        desirable = 1.0 - torch.sigmoid(beta * logratios)
        undesirable = torch.sigmoid(beta * logratios)
    else:
        raise ValueError(f"loss_type='{loss_type}' is unknown for KTO; use one of {list(LOSS_TYPES)}.")
    losses = torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)
    return losses.mean(), {"losses": losses.detach(), "rewards": beta * logratios.detach()}
