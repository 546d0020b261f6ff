"""``CPOModule``: contrastive preference optimisation and its reference-free relatives SimPO and AlphaPO (TRL's
CPOTrainer) on the pair batches of ``PreferenceDataModule``; the loss itself is the pure function ``cpo_loss``."""

from __future__ import annotations

import torch

from lightalign.knobs import takes_knobs
from lightalign.modules.losses.cpo import CPO_LOSS_TYPES, CPOLossConfig, cpo_loss  # noqa: F401  (public names)
from lightalign.modules.losses.implicit_reward import ImplicitRewardKnobs
from lightalign.modules.training.neftune import NEFTuneKnobs
from lightalign.modules.training.reference_free_pairs import ReferenceFreePairModule


@takes_knobs(NEFTuneKnobs, ImplicitRewardKnobs, CPOLossConfig, defaults={"disable_dropout": True})
class CPOModule(ReferenceFreePairModule):
    """Reference-free preference optimisation: CPO, SimPO and AlphaPO (TRL's CPOTrainer), no reference model.

    CPO (``loss_type`` ``sigmoid``, ``hinge``, ``ipo``), SimPO (``simpo``, usually with ``cpo_alpha=0``) and AlphaPO
    (``alphapo`` with ``alpha``): a preference loss on the policy's own log-probs plus ``cpo_alpha`` times the NLL
    of the chosen completions.

    Its knobs: the loss's (``CPOLossConfig``, with ``ImplicitRewardKnobs``' ``beta``), NEFTune's and
    ``PolicyModule``'s; ``disable_dropout`` defaults to on, as in TRL. Logged (``train/``, ``val/``): ``loss``,
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
    ``logps/rejected`` (per-token means for ``ipo``/``simpo``/``alphapo``) and ``nll_loss``.
    """

    method_name = "CPO"

    def check_knob_combinations(self) -> None:
        super().check_knob_combinations()
        self.knobs.implicit_reward.check_single(type(self).__name__)

    def pair_loss(self, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor,
                  rejected_lengths: torch.Tensor):
        return cpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, config=self.knobs.loss,
                        beta=self.knobs.implicit_reward.beta)
