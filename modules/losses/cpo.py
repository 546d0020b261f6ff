"""The CPO family of reference-free preference losses as pure tensor functions: ``cpo_loss`` (TRL's CPOTrainer:
CPO's sigmoid, hinge and IPO terms, SimPO, AlphaPO) and its knobs, ``CPOLossConfig``, checked once where the module
is built.

The loss types are a registered family (``CPO_LOSS_TYPES``): each names its term on the reward difference and
whether it compares length-normalised log-probs (mean per completion token: ``ipo``, ``simpo``, ``alphapo``),
reads ``label_smoothing`` and keeps the NLL term on the chosen completions. The reward of a completion is
``beta * log pi(y|x)`` (the implicit reward of DPO against a uniform reference, hence ``ImplicitRewardKnobs``'
``beta``), or, with ``alpha != 0``, AlphaPO's ``beta * (1 - pi^(-alpha)) / alpha``.
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

# (reward difference [B], config, beta) -> per-pair losses [B]
CPOTermFn = Callable[[torch.Tensor, "CPOLossConfig", float], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class CPOLossType:
    """A registered CPO loss type: its term, whether its log-probs are per-token means (``length_normalized``),
    whether it reads ``label_smoothing`` (``smoothed``) and whether the NLL term weighted by ``cpo_alpha`` is kept
    (``nll``; AlphaPO drops it, as TRL's ``loss_type="alphapo"`` sets ``cpo_alpha=0``)."""

    name: str
    fn: CPOTermFn
    length_normalized: bool
    smoothed: bool
    nll: bool = True


CPO_LOSS_TYPES: Registry[CPOLossType] = Registry("CPO loss_type")


def register_cpo_loss(name: str, *, length_normalized: bool, smoothed: bool,
                      nll: bool = True) -> Callable[[CPOTermFn], CPOTermFn]:
    """Register ``fn(reward_difference, config, beta) -> losses [B]`` as the CPO loss type ``name``."""

    def decorate(fn: CPOTermFn) -> CPOTermFn:
        CPO_LOSS_TYPES.add(name, CPOLossType(name, fn, length_normalized, smoothed, nll))
        return fn

    return decorate


def smoothed_sigmoid(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``-(1 - eps) log sigmoid(x) - eps log sigmoid(-x)``: the conservative (label-noise ``eps``) logistic loss."""
    return -(1 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)


@register_cpo_loss("sigmoid", length_normalized=False, smoothed=True)
def _sigmoid(difference: torch.Tensor, config: "CPOLossConfig", beta: float) -> torch.Tensor:
    return smoothed_sigmoid(beta * difference, config.label_smoothing)


@register_cpo_loss("hinge", length_normalized=False, smoothed=False)
def _hinge(difference: torch.Tensor, config: "CPOLossConfig", beta: float) -> torch.Tensor:
    return torch.relu(1 - beta * difference)


@register_cpo_loss("ipo", length_normalized=True, smoothed=False)
def _ipo(difference: torch.Tensor, config: "CPOLossConfig", beta: float) -> torch.Tensor:
    return (difference - 1 / (2 * beta)) ** 2


@register_cpo_loss("simpo", length_normalized=True, smoothed=True)
def _simpo(difference: torch.Tensor, config: "CPOLossConfig", beta: float) -> torch.Tensor:
    return smoothed_sigmoid(beta * difference - config.simpo_gamma, config.label_smoothing)


register_cpo_loss("alphapo", length_normalized=True, smoothed=True, nll=False)(_simpo)


@dataclasses.dataclass(frozen=True)
class CPOLossConfig(KnobGroup):
    """CPO's loss knobs (TRL's names and defaults), checked once here, at construction; its temperature ``beta`` is
    ``ImplicitRewardKnobs``' (the implicit reward ``beta * log pi``, a uniform reference)."""

    group = "loss"
    loss_type: str = knob(
        "sigmoid", "``sigmoid`` (CPO), ``hinge`` (SLiC), ``ipo`` (IPO on per-token mean log-probs), ``simpo`` "
                   "(SimPO: per-token mean log-probs, target margin ``simpo_gamma``) or ``alphapo`` (``simpo`` "
                   "without the NLL term, as TRL's ``alphapo`` sets ``cpo_alpha=0``; the reward shape is "
                   "``alpha``'s).")
    label_smoothing: float = knob(
        0.0, "assumed label-noise rate of ``sigmoid``/``simpo``/``alphapo`` (the conservative loss "
             "``-(1-e) logsig(x) - e logsig(-x)``), in [0, 0.5); ``hinge`` and ``ipo`` ignore it (a warning says so).")
    cpo_alpha: float = knob(
        1.0, "weight of the NLL term on the chosen completions (CPO's behaviour-cloning regulariser: the mean token "
             "NLL of the batch's chosen completions), >= 0; 0 is SimPO's recipe. ``alphapo`` drops the term (leave "
             "it at 1.0 or set 0).")
    simpo_gamma: float = knob(0.5, "``simpo``/``alphapo``'s target reward margin: the loss is "
                                   "``-logsig(beta * difference - simpo_gamma)``.")
    alpha: float = knob(
        0.0, "AlphaPO's reward shape for every loss type: 0 (default) compares log-probs; otherwise each "
             "compared log-prob ``l`` becomes ``(1 - exp(-alpha * l)) / alpha`` (``(1 - p^(-alpha)) / alpha``).")

    @property
    def variant(self) -> CPOLossType:
        """The registered loss type ``loss_type`` names."""
        return CPO_LOSS_TYPES[self.loss_type]

    @property
    def nll_weight(self) -> float:
        """The NLL term's weight: ``cpo_alpha``, 0 for a loss type without the term (``alphapo``)."""
        return self.cpo_alpha if self.variant.nll else 0.0

    def check(self) -> None:
        variant = self.variant  # refuses an unknown loss_type, listing the registered ones
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must lie in [0.0, 0.5), got {self.label_smoothing}.")
        if not (math.isfinite(self.cpo_alpha) and self.cpo_alpha >= 0):
            raise ValueError(f"cpo_alpha must be a finite number >= 0 (the NLL term's weight; TRL's default 1.0), "
                             f"got {self.cpo_alpha}.")
        if not variant.nll and self.cpo_alpha not in (0.0, 1.0):
            raise ValueError(f"loss_type={self.loss_type!r} has no NLL term (TRL sets cpo_alpha=0 for it), so "
                             f"cpo_alpha={self.cpo_alpha} would change nothing; use loss_type='simpo' to keep an "
                             "NLL term, or leave cpo_alpha unset.")
        for name in ("simpo_gamma", "alpha"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}.")
        if self.label_smoothing > 0 and not variant.smoothed:
            warnings.warn(f"label_smoothing={self.label_smoothing} is ignored by loss_type={self.loss_type!r}; only "
                          f"{[n for n in CPO_LOSS_TYPES.names() if CPO_LOSS_TYPES[n].smoothed]} read it.",
                          stacklevel=2)


def alphapo_rewards(logps: torch.Tensor, alpha: float) -> torch.Tensor:
    """AlphaPO's reward shape of log-probs ``l``: ``(1 - p^(-alpha)) / alpha = -expm1(-alpha * l) / alpha``
    (``l`` itself at ``alpha = 0``)."""
    if alpha == 0.0:
        return logps
    return -torch.expm1(-alpha * logps) / alpha


def chosen_nll(chosen_logps: torch.Tensor, chosen_lengths: torch.Tensor) -> torch.Tensor:
    """The mean token NLL of the batch's chosen completions: ``-sum(chosen log-probs) / sum(chosen tokens)`` (what a
    cross-entropy over every chosen completion token of the batch gives)."""
    return -chosen_logps.sum() / chosen_lengths.to(chosen_logps.dtype).sum()


def cpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    *,
    config: CPOLossConfig,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The CPO-family loss of a batch from summed completion log-probs ``[B]`` and completion token counts ``[B]``.

    The compared log-probs are the sums, or, for a ``length_normalized`` loss type, the per-token means (sum /
    count, the count clamped to >= 1); with ``alpha != 0`` each is reshaped by ``alphapo_rewards``. The loss is
    the mean of the loss type's term on ``chosen - rejected`` plus ``config.nll_weight * chosen_nll``. Computation
    is in float32 (float64 if an input is float64).

    Returns ``(loss, chosen_rewards [B], rejected_rewards [B], stats)``: the rewards ``beta * reshaped log-prob``
    (detached); ``stats``: ``logps/chosen`` and ``logps/rejected`` (batch means of the compared log-probs) and
    ``nll_loss`` (the chosen completions' mean token NLL, whatever its weight), detached.
    """
    variant = config.variant
    dtype = torch.float64 if torch.float64 in (chosen_logps.dtype, rejected_logps.dtype) else torch.float32
    chosen, rejected = chosen_logps.to(dtype), rejected_logps.to(dtype)
    nll = chosen_nll(chosen, chosen_lengths)
    if variant.length_normalized:
        chosen = chosen / chosen_lengths.to(dtype).clamp(min=1.0)
        rejected = rejected / rejected_lengths.to(dtype).clamp(min=1.0)
    chosen_shaped, rejected_shaped = alphapo_rewards(chosen, config.alpha), alphapo_rewards(rejected, config.alpha)
    loss = variant.fn(chosen_shaped - rejected_shaped, config, beta).mean()
    if config.nll_weight:
        loss = loss + config.nll_weight * nll
    stats = {"logps/chosen": chosen.detach().mean(), "logps/rejected": rejected.detach().mean(),
             "nll_loss": nll.detach()}
    return loss, beta * chosen_shaped.detach(), beta * rejected_shaped.detach(), stats
