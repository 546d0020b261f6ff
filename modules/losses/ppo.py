"""PPO's pure functions of tensors: the clipped policy and value losses, the KL coefficient controllers and the
score post-processing (``missing_eos_penalty``, ``use_score_scaling``, ``use_score_norm``, ``score_clip``); its
advantages (per-token rewards with the KL penalty, GAE, whitening) are with the other estimators
(``lightalign.modules.losses.advantages``).

Sources. TRL 1.16.0 ships no PPO trainer (no ``trl.experimental.ppo``); the formulas are those of TRL's two earlier
PPO trainers. The original ``PPOTrainer`` of TRL <= 0.11 (``trl.trainer.ppo_trainer`` at v0.11.4:
``compute_rewards``, ``compute_advantages``, ``loss`` and the score scaling of ``step``; ``AdaptiveKLController``,
``FixedKLController`` and ``RunningMoments`` in ``trl.trainer.utils``; ``masked_whiten`` in ``trl.core``) gives
``token_rewards`` (k1 penalty, score on the last completion token), ``gae``, ``whiten``, both clipped losses, the KL
controllers and ``ScoreProcessor``'s scaling, normalisation and clipping. Its successor (``PPOv2Trainer`` in
0.9-0.11, ``trl.trainer.ppo_trainer`` in 0.12-0.25, ``trl.experimental.ppo.ppo_trainer`` from 0.26, checked
at v1.9.0) keeps the same GAE recursion, whitening and clipped losses and adds ``missing_eos_penalty``.

Tensors are ``[B, T]`` over the completion tokens with a 0/1 ``mask`` (1 on the completion through its EOS). The
losses take ``num_tokens``: the token count they are normalised by (default the mask's own count). ``PPOModule``
passes the tokens of the whole optimizer step, so gradient accumulation gives the gradient of one big batch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from lightalign.knobs import KnobGroup, knob
from lightalign.modules.losses.advantages import RunningRewardNormalizer, apply_missing_eos_penalty, masked_mean
from lightalign.modules.losses.importance_sampling import check_ratio_shape

__all__ = ["AdaptiveKLController", "FixedKLController", "KLControllerKnobs", "PPOLossKnobs", "ScoreKnobs",
           "ScoreProcessor", "clipped_policy_loss", "clipped_value_loss", "explained_variance"]


@dataclasses.dataclass(frozen=True)
class PPOLossKnobs(KnobGroup):
    """PPO's two clipped losses (``clipped_policy_loss``, ``clipped_value_loss``) and the weight of the second."""

    group = "ppo_loss"
    cliprange: float = knob(0.2, "the policy ratio's clipping range ``[1 - cliprange, 1 + cliprange]``.")
    cliprange_value: float = knob(0.2, "the values' clipping range around the rollout's values.")
    vf_coef: float = knob(0.1, "weight of the value loss; 0 trains the value head not at all.")

    def check(self) -> None:
        if not self.cliprange > 0:
            raise ValueError(f"cliprange must be > 0, got {self.cliprange}.")
        if not self.cliprange_value > 0:
            raise ValueError(f"cliprange_value must be > 0, got {self.cliprange_value}.")
        if not self.vf_coef >= 0:
            raise ValueError(f"vf_coef must be >= 0 (the value loss's weight), got {self.vf_coef}.")


@dataclasses.dataclass(frozen=True)
class KLControllerKnobs(KnobGroup):
    """The coefficient of the per-token KL penalty in PPO's rewards and how it moves (``FixedKLController``,
    ``AdaptiveKLController``)."""

    group = "kl_control"
    kl_coef: float = knob(
        0.05, "coefficient of the per-token KL penalty ``logp - ref_logp`` in the reward (TRL 0.12-1.9's name, 0.05 "
              "there; TRL <= 0.11's ``init_kl_coef``); the start value of the adaptive controller. 0: no reference "
              "model.")
    adap_kl_ctrl: bool = knob(
        False, "the adaptive KL controller (``AdaptiveKLController``: the coefficient follows the measured KL towards "
               "``target`` over ``horizon`` completions); off by default; only TRL <= 0.11 had it (on, with "
               "``init_kl_coef`` 0.2); TRL 0.12-1.9's PPOTrainer keeps ``kl_coef`` fixed. Its state is checkpointed.")
    target: float = knob(6.0, "the KL the adaptive controller aims at (per completion, summed over its tokens).")
    horizon: float = knob(10000.0, "the adaptive controller's horizon (completions over which it closes the gap to "
                                   "``target``).")

    def check(self) -> None:
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0 (the KL penalty's coefficient; 0: none), got {self.kl_coef}.")
        if self.adap_kl_ctrl and not (self.target > 0 and self.horizon > 0):
            raise ValueError(f"adap_kl_ctrl needs target > 0 and horizon > 0, got target={self.target}, "
                             f"horizon={self.horizon}.")

    def controller(self) -> "FixedKLController | AdaptiveKLController":
        """The controller these knobs ask for, at its start value."""
        if self.adap_kl_ctrl:
            return AdaptiveKLController(self.kl_coef, self.target, self.horizon)
        return FixedKLController(self.kl_coef)


@dataclasses.dataclass(frozen=True)
class ScoreKnobs(KnobGroup):
    """How ``ScoreProcessor`` scales and clamps a rollout's scores (TRL <= 0.11's PPO knobs)."""

    group = "score"
    use_score_scaling: bool = knob(False, "divide scores by their running std (statistics of every rank's scores, "
                                          "checkpointed).")
    use_score_norm: bool = knob(False, "also subtract the running mean (needs ``use_score_scaling``, as in TRL).")
    score_clip: float | None = knob(None, "clamp the (scaled) scores to ``[-score_clip, score_clip]``; None: no clamp.")

    def check(self) -> None:
        if self.score_clip is not None and not self.score_clip > 0:
            raise ValueError(f"score_clip must be > 0 or null, got {self.score_clip}.")
        if self.use_score_norm and not self.use_score_scaling:
            raise ValueError("use_score_norm normalises with the running statistics of use_score_scaling: set "
                             "use_score_scaling true too (as in TRL, where use_score_norm alone does nothing).")


def clipped_policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        cliprange: float, num_tokens: torch.Tensor | float | None = None, *,
                        importance_sampling_ratio: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate: per token ``rho * max(-A * r, -A * clip(r, 1 - cliprange, 1 + cliprange))`` with
    ``r = exp(logp - old_logp)``, summed over the mask and divided by ``num_tokens`` (default: the mask's count).
    Stats (masked means over this batch, not weighted by ``rho``): ``approxkl`` ``0.5 * (logp - old_logp)^2``,
    ``clipfrac`` (tokens where the clipped branch is the larger).

    ``importance_sampling_ratio``: ``rho`` (default 1), the detached ratio ``pi_old / pi_sampler`` of
    ``importance_sampling_ratio`` for rollouts drawn by another sampler (vLLM): ``[B, T]`` (token modes) or
    ``[B, 1]`` (sequence modes: one weight per completion, the same on each of its tokens). It weights the clipped
    term of each token, as verl's truncated importance sampling weights its PPO policy loss; the value loss and the
    KL penalty (in the rewards) never see it. Its values off the mask are never read."""
    check_ratio_shape(importance_sampling_ratio, logps)
    mask_f = mask.to(logps.dtype)
    diff = logps - old_logps
    ratio = torch.exp(diff)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    denom = mask_f.sum().clamp(min=1) if num_tokens is None else num_tokens
    per_token = torch.max(unclipped, clipped)
    if importance_sampling_ratio is not None:
        rho = importance_sampling_ratio.detach().to(per_token.dtype)
        if rho.shape[1] != 1:  # off the mask: 1, so a NaN or inf there cannot reach the sum
            rho = torch.where(mask.bool(), rho, torch.ones((), dtype=rho.dtype, device=rho.device))
        per_token = per_token * rho
    loss = (per_token * mask_f).sum() / denom
    with torch.no_grad():
        stats = {"approxkl": masked_mean(0.5 * diff ** 2, mask), "clipfrac": masked_mean((clipped > unclipped).float(), mask)}
    return loss, stats


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       cliprange_value: float, num_tokens: torch.Tensor | float | None = None
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss: per token ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``, summed
    over the mask and divided by ``num_tokens`` (default: the mask's count). Stats: ``clipfrac`` (tokens where the
    clipped branch is the larger). Multiply by ``vf_coef`` to add it to the policy loss."""
    mask_f = mask.to(values.dtype)
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    denom = mask_f.sum().clamp(min=1) if num_tokens is None else num_tokens
    loss = 0.5 * (torch.max(unclipped, clipped) * mask_f).sum() / denom
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped > unclipped).float(), mask)}
    return loss, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - var(R - V) / var(R)`` over the masked tokens (population variances); NaN when the returns are constant."""
    residual = returns - values
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    var_res = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return 1 - var_res / var_r if var_r > 0 else torch.tensor(float("nan"), device=values.device)


class FixedKLController:
    """A constant KL coefficient (``adap_kl_ctrl: false``)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing changes."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al.'s proportional controller (``adap_kl_ctrl: true``): after each rollout of ``n_steps``
    completions whose mean KL (per completion, summed over its tokens) is ``current_kl``,
    ``value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value, self.target, self.horizon = float(init_kl_coef), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class ScoreProcessor:
    """The score knobs, applied in this order to a rollout's scores ``[N]``: ``missing_eos_penalty`` is subtracted
    from completions without EOS; ``use_score_scaling`` divides by the running std of every score seen so far
    (``use_score_norm`` also subtracts the running mean first); ``score_clip`` clamps to ``[-clip, clip]``.

    The running statistics (Welford moments, this rollout's scores included; the unbiased std, 1 before two scores
    were seen) are checkpointed through ``state_dict``. Under data parallelism pass every rank's scores as ``pool``.
    """

    def __init__(self, missing_eos_penalty: float | None = None, use_score_scaling: bool = False,
                 use_score_norm: bool = False, score_clip: float | None = None):
        self.missing_eos_penalty = missing_eos_penalty
        self.use_score_scaling, self.use_score_norm, self.score_clip = use_score_scaling, use_score_norm, score_clip
        self.moments = RunningRewardNormalizer()

    def penalize(self, scores: torch.Tensor, has_eos: torch.Tensor) -> torch.Tensor:
        return apply_missing_eos_penalty(scores, has_eos, self.missing_eos_penalty)

    def running_std(self) -> float:
        m = self.moments
        return math.sqrt(m.m2 / (m.count - 1)) if m.count > 1 else 1.0

    def scale(self, scores: torch.Tensor, pool: torch.Tensor | None = None) -> torch.Tensor:
        if self.use_score_scaling:
            self.moments.update(scores if pool is None else pool)
            denom = self.running_std() + torch.finfo(scores.dtype).eps
            scores = ((scores - self.moments.mean) if self.use_score_norm else scores) / denom
        if self.score_clip is not None:
            scores = scores.clamp(-self.score_clip, self.score_clip)
        return scores

    def state_dict(self) -> dict[str, float]:
        return self.moments.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.moments.load_state_dict(state)
