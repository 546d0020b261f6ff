"""``ORPOModule``: odds-ratio preference optimisation (TRL's ORPOTrainer) on the pair batches of
``PreferenceDataModule``; the loss itself is the pure function ``orpo_loss``."""

from __future__ import annotations

import torch

from lightalign.knobs import takes_knobs
from lightalign.modules.losses.orpo import ORPOLossKnobs, orpo_loss  # noqa: F401  (public names)
from lightalign.modules.training.neftune import NEFTuneKnobs
from lightalign.modules.training.reference_free_pairs import PAIR_LOSS_STATS, ReferenceFreePairModule


@takes_knobs(NEFTuneKnobs, ORPOLossKnobs, defaults={"disable_dropout": True})
class ORPOModule(ReferenceFreePairModule):
    """Odds-ratio preference optimisation (TRL's ORPOTrainer): SFT and preference alignment in one loss, no reference.

    The NLL of the whole chosen sequences (prompt tokens included, as TRL computes it) plus ``beta`` (the paper's
    lambda) times the odds-ratio term on the completions' per-token mean log-probs. In the shared-prompt layout the
    pair's one forward also computes logits at the prompt positions for it (``completion_and_prompt_logps``).

    Its knobs: ``ORPOLossKnobs``' ``beta``, NEFTune's and ``PolicyModule``'s; ``disable_dropout`` defaults to on,
    as in TRL. Logged (``train/``, ``val/``): ``loss``, ``rewards/*`` (``beta`` times the mean log-probs),
    ``logps/chosen``, ``logps/rejected``, ``nll_loss``, ``log_odds_ratio`` and ``log_odds_chosen`` (TRL's names).
    """

    method_name = "ORPO"
    logged_stats = (*PAIR_LOSS_STATS, "log_odds_ratio", "log_odds_chosen")
    scores_chosen_prompt = True

    def pair_loss(self, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor,
                  rejected_lengths: torch.Tensor, *prompt: torch.Tensor):
        return orpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, *prompt,
                         config=self.knobs.loss)
