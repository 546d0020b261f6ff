"""ORPO's loss as a pure tensor function (``orpo_loss``: TRL's ORPOTrainer, odds-ratio preference optimisation) and
its knob, ``ORPOLossKnobs``: the NLL of the whole chosen sequences (prompt and completion tokens, as TRL's
ORPOTrainer computes it) plus ``beta`` times the odds-ratio term on the completions, no reference model.

The odds of a completion are ``p / (1 - p)`` with ``p = exp(mean token log-prob)``; the odds-ratio term is
``-log sigmoid(log odds(chosen) - log odds(rejected))``. ORPO's ``beta`` is the weight of that term (the paper's
``lambda``), another idea than DPO's implicit-reward temperature, though TRL names both ``beta``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from lightalign.knobs import KnobGroup, knob

LOG_HALF = -math.log(2.0)


@dataclasses.dataclass(frozen=True)
class ORPOLossKnobs(KnobGroup):
    """ORPO's loss knob (TRL's name and default), checked once here, at construction."""

    group = "loss"
    beta: float = knob(
        0.1, "weight of the odds-ratio term against the chosen completions' NLL (the ORPO paper's lambda; TRL's "
             "default 0.1), >= 0; 0 is plain supervised fine-tuning on the chosen completions.")

    def check(self) -> None:
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise ValueError(f"beta (ORPO's odds-ratio weight lambda) must be a finite number >= 0 (TRL's default "
                             f"0.1), got {self.beta}.")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, without cancellation (``log1p(-exp(x))`` below ``-log 2``,
    ``log(-expm1(x))`` above)."""
    return torch.where(x < LOG_HALF, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def log_odds_ratio(chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor) -> torch.Tensor:
    """``log odds(chosen) - log odds(rejected)`` per pair, the odds of a completion being ``p / (1 - p)`` with
    ``p = exp(mean token log-prob)``."""
    return (chosen_mean_logps - rejected_mean_logps) - (log1mexp(chosen_mean_logps) - log1mexp(rejected_mean_logps))


def orpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    chosen_prompt_logps: torch.Tensor,
    chosen_prompt_lengths: torch.Tensor,
    *,
    config: ORPOLossKnobs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO's loss of a batch from summed completion log-probs ``[B]`` and completion token counts ``[B]``, and
    the chosen sequences' summed log-probs of their predicted prompt tokens ``[B]`` (every prompt token but the
    first) and those tokens' counts ``[B]``: ``nll - beta * mean(log sigmoid(log_odds_ratio))``.

    ``nll`` is the mean token NLL over every predicted token of the batch's chosen sequences, prompt and completion
    (one token mean over the batch, not a mean of per-sequence means: TRL's cross-entropy over the chosen rows).
    The odds ratio compares the completions' per-token mean log-probs (counts clamped to >= 1). Computation is in
    float32 (float64 if an input is float64).

    Returns ``(loss, chosen_rewards [B], rejected_rewards [B], stats)``: the rewards ``beta * mean log-prob``
    (detached); ``stats`` (TRL's names, detached): ``logps/chosen``, ``logps/rejected`` (batch means of the
    per-token mean log-probs), ``nll_loss``, ``log_odds_ratio`` (the batch mean of ``log sigmoid`` of the log odds
    ratio) and ``log_odds_chosen`` (the batch mean of the log odds ratio).
    """
    dtype = torch.float64 if torch.float64 in (chosen_logps.dtype, rejected_logps.dtype) else torch.float32
    chosen, rejected = chosen_logps.to(dtype), rejected_logps.to(dtype)
    prompt = chosen_prompt_logps.to(dtype)
    nll = -(chosen.sum() + prompt.sum()) / (chosen_lengths.sum() + chosen_prompt_lengths.sum()).to(dtype)
    chosen = chosen / chosen_lengths.to(dtype).clamp(min=1.0)
    rejected = rejected / rejected_lengths.to(dtype).clamp(min=1.0)
    log_odds = log_odds_ratio(chosen, rejected)
    ratio = F.logsigmoid(log_odds)
    loss = nll - config.beta * ratio.mean()
    stats = {"logps/chosen": chosen.detach().mean(), "logps/rejected": rejected.detach().mean(),
             "nll_loss": nll.detach(), "log_odds_ratio": ratio.detach().mean(),
             "log_odds_chosen": log_odds.detach().mean()}
    return loss, config.beta * chosen.detach(), config.beta * rejected.detach(), stats
