"""TPO's loss as a pure function of per-sequence log-probs (no model, no data), its loss types registered by name,
and its knobs, ``TPOLossConfig``.

Facts from TRL 1.16's experimental ``TPOTrainer`` (triple preference optimisation, arXiv 2405.16681):

* TPO is reference-free: no reference policy; the implicit reward of a completion is ``beta * logp`` with
  ``logp`` the policy's log-prob of the completion, summed over its tokens, or averaged over them (length
  normalised) for ``ipo`` and ``tpo-l``;
* the preference term compares chosen with rejected through ``delta = logp_chosen - logp_rejected``, one value per
  triple, averaged over the micro-batch;
* the third response of a row, the gold ``reference`` completion, enters only through a supervised term: the
  negative log-likelihood of its tokens, averaged over every reference token of the micro-batch, weighted by
  ``tpo_alpha`` and added to the preference term (``tpo_alpha = 0`` drops it and its forward).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from lightalign.knobs import KnobGroup, knob
from lightalign.modules.losses.registry import Registry


@dataclasses.dataclass(frozen=True)
class TPOLossType:
    """A registered TPO loss type: ``fn(delta, config) -> per-triple loss [B]``; ``length_normalized``: it compares
    mean per-token log-probs (else sums); ``smoothed``: it reads ``label_smoothing``."""

    name: str
    fn: Callable[[torch.Tensor, "TPOLossConfig"], torch.Tensor]
    length_normalized: bool
    smoothed: bool


TPO_LOSS_TYPES: Registry[TPOLossType] = Registry("TPO loss_type")


def register_tpo_loss(name: str, *, length_normalized: bool, smoothed: bool):
    """Register ``fn(delta, config) -> [B]`` as the TPO loss type ``name``."""

    def decorate(fn):
        TPO_LOSS_TYPES.add(name, TPOLossType(name, fn, length_normalized, smoothed))
        return fn

    return decorate


def _smoothed_logsigmoid(margin: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Bradley-Terry loss of ``margin`` with the preference label flipped at rate ``label_smoothing``."""
    return -F.logsigmoid(margin) * (1 - label_smoothing) - F.logsigmoid(-margin) * label_smoothing


@register_tpo_loss("sigmoid", length_normalized=False, smoothed=True)
def _sigmoid(delta: torch.Tensor, config: "TPOLossConfig") -> torch.Tensor:
    return _smoothed_logsigmoid(config.beta * delta, config.label_smoothing)


@register_tpo_loss("hinge", length_normalized=False, smoothed=False)
def _hinge(delta: torch.Tensor, config: "TPOLossConfig") -> torch.Tensor:
    return torch.relu(1 - config.beta * delta)


@register_tpo_loss("ipo", length_normalized=True, smoothed=False)
def _ipo(delta: torch.Tensor, config: "TPOLossConfig") -> torch.Tensor:
    return (delta - 1 / (2 * config.beta)) ** 2  # beta is IPO's regulariser tau


@register_tpo_loss("tpo-l", length_normalized=True, smoothed=True)
def _tpo_l(delta: torch.Tensor, config: "TPOLossConfig") -> torch.Tensor:
    return _smoothed_logsigmoid(config.beta * (delta - config.tpo_l_gamma / config.beta), config.label_smoothing)


@dataclasses.dataclass(frozen=True)
class TPOLossConfig(KnobGroup):
    """TPO's loss knobs (TRL 1.16's names and defaults), checked once here, at construction."""

    group = "loss"
    loss_type: str = knob(
        "sigmoid", "``sigmoid`` (the TPO paper's Bradley-Terry loss on summed log-probs), ``hinge`` (SLiC), ``ipo`` "
                   "(IPO's squared loss on length-normalised log-probs) or ``tpo-l`` (length-normalised TPO with the "
                   "target margin ``tpo_l_gamma``).")
    beta: float = knob(
        0.01, "temperature of TPO's reference-free implicit reward ``beta * log pi`` (TRL's default 0.01); for "
              "``ipo`` the regulariser tau. > 0.")
    label_smoothing: float = knob(
        0.0, "assumed rate of flipped preference labels for ``sigmoid`` and ``tpo-l``, in [0, 0.5) (``hinge`` and "
             "``ipo`` ignore it, with a warning, as TRL).")
    tpo_alpha: float = knob(
        1.0, "weight of the negative log-likelihood of the gold ``reference`` response (mean over its tokens) added "
             "to the loss; >= 0. 0 drops the term and its forward: the batches then hold chosen and rejected only.")
    tpo_l_gamma: float = knob(0.5, "target reward margin gamma of ``tpo-l`` (TRL's default 0.5); the others ignore it.")

    def check(self) -> None:
        kind = TPO_LOSS_TYPES[self.loss_type]  # refuses an unknown name, listing the registered ones
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ValueError(f"beta must be a finite number > 0 (TRL's TPO default is 0.01), got {self.beta}.")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must lie in [0.0, 0.5), got {self.label_smoothing}.")
        if not (self.tpo_alpha >= 0 and math.isfinite(self.tpo_alpha)):
            raise ValueError(f"tpo_alpha must be a finite number >= 0 (0 drops the gold response's NLL term; "
                             f"TRL's default is 1.0), got {self.tpo_alpha}.")
        if not math.isfinite(self.tpo_l_gamma):
            raise ValueError(f"tpo_l_gamma must be a finite number (TRL's default 0.5), got {self.tpo_l_gamma}.")
        if self.label_smoothing > 0 and not kind.smoothed:
            warnings.warn(f"label_smoothing={self.label_smoothing} is ignored by TPO loss_type '{self.loss_type}'; "
                          "only 'sigmoid' and 'tpo-l' read it.", stacklevel=2)

    @property
    def length_normalized(self) -> bool:
        """Whether ``loss_type`` compares mean per-token log-probs (``ipo``, ``tpo-l``) rather than sums."""
        return TPO_LOSS_TYPES[self.loss_type].length_normalized


def tpo_loss(
    chosen_logp_sums: torch.Tensor,
    rejected_logp_sums: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    reference_token_logps: torch.Tensor | None,
    config: TPOLossConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TPO over one micro-batch of triples.

    Args:
        chosen_logp_sums, rejected_logp_sums: ``[B]`` summed completion log-probs under the policy (with graph).
        chosen_lengths, rejected_lengths: ``[B]`` completion tokens of each (what ``ipo`` and ``tpo-l`` divide by,
            at least 1).
        reference_token_logps: the log-prob of every token of the micro-batch's gold ``reference`` completions,
            flattened (``[K]``); ``None`` without the term (``tpo_alpha = 0``: the batch has no reference rows).
        config: the loss knobs.

    Returns ``(loss, stats)``: the scalar ``mean(per-triple loss) + tpo_alpha * NLL`` and, detached,
    ``chosen_logps`` / ``rejected_logps`` (as compared: sums, or means per token), ``rewards_chosen`` /
    ``rewards_rejected`` (``beta *`` those) and ``nll`` (0 without the term).
    """
    chosen, rejected = chosen_logp_sums.float(), rejected_logp_sums.float()
    if config.length_normalized:
        chosen = chosen / chosen_lengths.clamp(min=1).to(chosen)
        rejected = rejected / rejected_lengths.clamp(min=1).to(rejected)
    loss = TPO_LOSS_TYPES[config.loss_type].fn(chosen - rejected, config).mean()
    nll = loss.new_zeros(())
    if reference_token_logps is not None:
        nll = -reference_token_logps.float().mean()
        loss = loss + config.tpo_alpha * nll
    chosen, rejected = chosen.detach(), rejected.detach()
    return loss, {"chosen_logps": chosen, "rejected_logps": rejected, "rewards_chosen": config.beta * chosen,
                  "rewards_rejected": config.beta * rejected, "nll": nll.detach()}
