"""``ImplicitRewardKnobs``: the temperature ``beta`` of the implicit reward ``beta * log(pi / pi_ref)`` that the
offline preference losses compare (``dpo_loss``, ``kto_loss``); one knob, one check, for both methods."""

from __future__ import annotations

import dataclasses

from lightalign.knobs import KnobGroup, knob


@dataclasses.dataclass(frozen=True)
class ImplicitRewardKnobs(KnobGroup):
    """The implicit reward's temperature (DPO, KTO)."""

    group = "implicit_reward"
    beta: float = knob(
        0.1, "the temperature of the implicit reward ``beta * log(pi / pi_ref)`` (TRL's ``beta``): the strength of "
             "the implicit KL penalty, higher keeps the policy closer to the reference; > 0 (TRL's default 0.1, "
             "typical values 0.1-0.5).")

    def check(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0 (TRL's default is 0.1; typical values 0.1-0.5), got {self.beta}.")
