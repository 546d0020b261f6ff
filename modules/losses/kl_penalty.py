"""The KL coefficient against the reference model of the critic-free methods (``KLKnobs``)."""

from __future__ import annotations

import dataclasses

from lightalign.knobs import KnobGroup, knob


@dataclasses.dataclass(frozen=True)
class KLKnobs(KnobGroup):
    """TRL's ``beta`` of GRPO and RLOO: how strongly the policy is held to the reference (a method states its
    default)."""

    group = "kl"
    beta: float = knob(
        0.0, "KL coefficient against a reference model, which is built only when ``beta > 0``: GRPO adds the per-token "
             "k3 term ``beta * KL`` to its loss (``use_bias_correction_kl``); RLOO takes ``beta * sum_t (logp_old - "
             "logp_ref)`` from each completion's reward before the baselines (TRL's defaults: GRPO 0.0, RLOO 0.05).")

    def check(self) -> None:
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0 (the KL coefficient; 0.0 disables the KL term), got {self.beta}.")
