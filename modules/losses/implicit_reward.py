"""``ImplicitRewardKnobs``: the temperature ``beta`` of the implicit reward ``beta * log(pi / pi_ref)`` that the
offline preference losses compare (``dpo_loss``, ``kto_loss``, and ``cpo_loss`` against a uniform reference: the
reward ``beta * log pi``); one knob, one check, for every such method; and ``reward_stats``, the statistics TRL logs of
a batch's pair rewards."""

from __future__ import annotations

import dataclasses

import torch

from lightalign.knobs import KnobGroup, knob


@dataclasses.dataclass(frozen=True)
class ImplicitRewardKnobs(KnobGroup):
    """The implicit reward's temperature (DPO, KTO, online DPO; CPO and SimPO, whose reference is uniform)."""

    group = "implicit_reward"
    beta: float | list[float] = knob(
        0.1, "the temperature of the implicit reward ``beta * log(pi / pi_ref)`` (TRL's ``beta``): the strength of "
             "the implicit KL penalty, higher keeps the policy closer to the reference (for ``ipo`` the regulariser "
             "tau); > 0 (TRL's default 0.1, typical values 0.1-0.5). Online DPO also takes a list: one value per "
             "epoch, the last reused after (TRL's ``OnlineDPOConfig``). CPO has no reference model: its reward is "
             "``beta * log pi`` (the reference uniform).")

    def check(self) -> None:
        if isinstance(self.beta, (list, tuple)):
            if not self.beta or any(not float(b) > 0 for b in self.beta):
                raise ValueError(f"beta must be > 0, or a non-empty list of values > 0 (one per epoch), got "
                                 f"{self.beta!r}.")
        elif not self.beta > 0:
            raise ValueError(f"beta must be > 0 (TRL's default is 0.1; typical values 0.1-0.5), got {self.beta}.")

    def check_single(self, method: str) -> None:
        """A method with one temperature for the whole run refuses a per-epoch list."""
        if isinstance(self.beta, (list, tuple)):
            raise ValueError(f"beta is one number for {method}; a list of values, one per epoch, is online DPO's "
                             f"(got {self.beta!r}).")


REWARD_STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def reward_stats(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's statistics of a batch's pair rewards ``[B]`` (``REWARD_STATS``): the means of each reward, of
    ``chosen > rejected`` and of the margin."""
    return {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean()}
