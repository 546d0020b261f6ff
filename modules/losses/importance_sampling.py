"""Importance-sampling correction for rollouts whose tokens were drawn by a sampler other than the trained policy.

The sampler (vLLM, another inference engine, or the same weights under different kernels and precision) reports a
log-probability for every token it drew; the trainer recomputes the log-probability of the same token at rollout
time (GRPO's ``old_per_token_logps``). The two differ, so the rollout is slightly off-policy even before the first
optimizer step. The ratio ``rho = pi_trainer(y) / pi_sampler(y)`` re-weights the policy term of the loss towards the
trainer's own distribution; because a few tokens can have a huge ratio, it is constrained to
``[clip_min, clip_max]`` in one of four ways (TRL 1.16's ``vllm_importance_sampling_mode``):

  - ``token_truncate``:    per token ``rho_t = exp(d_t)``, clamped to ``[clip_min, clip_max]``;
  - ``token_mask``:        per token ``rho_t = exp(d_t)``, set to 0 where it falls outside ``[clip_min, clip_max]``;
  - ``sequence_truncate``: per sequence ``rho = exp(sum_t d_t)``, clamped;
  - ``sequence_mask``:     per sequence ``rho = exp(sum_t d_t)``, set to 0 (the whole sequence dropped) outside,

with ``d_t = trainer_t - sampler_t`` on the real tokens, 0 on padding and wherever the sampler's log-prob is NaN
(a token it could not score gets no correction). ``None`` for a bound leaves that side open.

Knob names and defaults are TRL's: ``vllm_importance_sampling_correction`` (True),
``vllm_importance_sampling_mode`` ('sequence_mask'), ``vllm_importance_sampling_clip_min`` (None),
``vllm_importance_sampling_clip_max`` (3.0); TRL's deprecated ``vllm_importance_sampling_cap`` names
``clip_max`` (refused, naming it). The losses take the result as ``importance_sampling_ratio`` (``grpo_loss``,
``rloo_loss``, ``clipped_policy_loss``, where the trainer's side is PPO's
``old_logps``, as verl's truncated importance sampling corrects PPO; TRL has no PPO).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from lightalign.knobs import KnobGroup, knob

import math

import torch

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SEQUENCE_MODES = ("sequence_truncate", "sequence_mask")  # one ratio per sequence, shape [B, 1]


@dataclasses.dataclass(frozen=True)
class ImportanceSamplingKnobs(KnobGroup):
    """The correction of rollouts not sampled by the policy being trained (TRL's names and defaults)."""

    group = "importance_sampling"
    vllm_importance_sampling_correction: bool = knob(
        True, "when the rollouts are not sampled by the policy being trained (``use_vllm``, or GRPO's and RLOO's "
              "``max_staleness > 0``), weight the policy term of the loss by the importance-sampling ratio "
              "``pi_policy / pi_sampler`` of the sampled tokens at rollout time (TRL's name and default): GRPO's "
              "per-token policy term, PPO's per-token clipped term, RLOO's per-completion term; never a KL term nor "
              "PPO's value loss. The mismatch itself (``sampling/*``) is logged either way. No effect when the policy "
              "samples its own rollouts.")
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = knob(
        "sequence_mask", "``token_truncate`` / ``sequence_truncate`` clip the ratio (per token, or one per completion: "
                         "the product of its tokens' ratios) to [``clip_min``, ``clip_max``]; ``token_mask`` / "
                         "``sequence_mask`` set ratios outside it to 0 (those tokens or completions get no policy "
                         "gradient); a completion's ratio weights each of its tokens in GRPO and PPO. RLOO's loss is "
                         "per completion: ``sequence_*`` only.")
    vllm_importance_sampling_clip_min: float | None = knob(None, "the ratio's lower bound (None: none).")
    vllm_importance_sampling_clip_max: float | None = knob(3.0, "the ratio's upper bound (None: none).")

    def check(self) -> None:
        check_importance_sampling_knobs(self.vllm_importance_sampling_correction, self.vllm_importance_sampling_mode,
                                        self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max)

def check_importance_sampling_knobs(correction: bool, mode: str, clip_min: float | None,
                                    clip_max: float | None) -> None:
    """Check the four ``vllm_importance_sampling_*`` knobs; raise ``ValueError`` naming the knob and what to do.

    Checked whether or not ``correction`` is on, so a typo surfaces when it is written, not when the correction is
    first switched on. Both bounds ``None`` is accepted in every mode: the ratio is then the plain, unconstrained
    importance weight (TRL refuses that combination for the ``*_truncate`` modes only because its clamp call would
    fail; a mask mode with no bound is the same weight)."""
    if not isinstance(correction, bool):
        raise ValueError(f"vllm_importance_sampling_correction must be true or false, got {correction!r}.")
    if mode not in IMPORTANCE_SAMPLING_MODES:
        valid = ", ".join(repr(m) for m in IMPORTANCE_SAMPLING_MODES)
        raise ValueError(f"vllm_importance_sampling_mode={mode!r} is unknown; use one of {valid} (TRL's default is "
                         "'sequence_mask').")
    for name, value in (("vllm_importance_sampling_clip_min", clip_min),
                        ("vllm_importance_sampling_clip_max", clip_max)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{name} must be a number or null (no bound on that side), got {value!r}.")
    if clip_max is not None and not clip_max > 0:
        raise ValueError(f"vllm_importance_sampling_clip_max must be > 0 (importance ratios are positive; TRL's "
                         f"default is 3.0) or null for no upper bound, got {clip_max}.")
    if clip_min is not None and not (clip_min >= 0 and math.isfinite(clip_min)):
        raise ValueError(f"vllm_importance_sampling_clip_min must be a finite number >= 0 (importance ratios are "
                         f"positive) or null for no lower bound, got {clip_min}.")
    if clip_min is not None and clip_max is not None and not clip_min < clip_max:
        raise ValueError(f"vllm_importance_sampling_clip_min ({clip_min}) must be < vllm_importance_sampling_clip_max "
                         f"({clip_max}); lower it, raise clip_max, or set one of them to null.")


def _float_pair(trainer_logps: torch.Tensor, sampling_logps: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both log-prob tensors in float32 (float64 if either is), and the mask as bool; shapes checked."""
    if trainer_logps.dim() != 2 or sampling_logps.shape != trainer_logps.shape or mask.shape != trainer_logps.shape:
        raise ValueError(f"trainer_logps, sampling_logps and mask must all be [B, T]; got "
                         f"{tuple(trainer_logps.shape)}, {tuple(sampling_logps.shape)} and {tuple(mask.shape)}.")
    dtype = torch.float64 if torch.float64 in (trainer_logps.dtype, sampling_logps.dtype) else torch.float32
    return trainer_logps.detach().to(dtype), sampling_logps.detach().to(dtype), mask.bool()


@torch.no_grad()
def importance_sampling_ratio(
    trainer_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The constrained importance ratio ``pi_trainer / pi_sampler`` of a rollout, and its statistics.

    ``trainer_logps``: the trainer's per-token log-probs of the sampled tokens at rollout time (GRPO's
    ``old_per_token_logps``), ``[B, T]``. ``sampling_logps``: the sampler's, ``[B, T]``, NaN where it gave none.
    ``mask``: ``[B, T]``, nonzero on the tokens the loss trains on. ``mode``, ``clip_min``, ``clip_max``: see the
    module docstring (checked by ``check_importance_sampling_knobs``).

    Per token ``d_t = trainer_t - sampler_t`` on the real tokens; 0 on padding and where ``d_t`` is NaN; +-inf
    become the largest finite value, so an unscorable extreme gives a ratio of 0 or inf (then constrained), never NaN.
    Returns ``(ratio, stats)``:

      - ``ratio``: detached, float32 (float64 if either log-prob tensor is), ``[B, T]`` for the token modes or
        ``[B, 1]`` for the sequence modes; exactly 1 on padding and for a sequence with no real token (neutral,
        whatever the bounds). Multiply it into the policy term.
      - ``stats`` (detached scalars): ``ratio_min``, ``ratio_mean``, ``ratio_max`` of the ratio *after* truncation
        or masking (TRL logs those as ``sampling/importance_sampling_ratio/min|mean|max``), over the real tokens
        (token modes) or over the sequences with at least one real token (sequence modes; TRL also counts a
        sequence with no real token, whose ratio is exactly 1); ``out_of_bounds_fraction``, the fraction of those
        tokens or sequences whose raw ratio lay outside ``[clip_min, clip_max]`` (so was truncated or masked).
        All 0 when nothing is counted (an empty mask), as TRL reports.
    """
    check_importance_sampling_knobs(True, mode, clip_min, clip_max)
    trainer, sampler, real = _float_pair(trainer_logps, sampling_logps, mask)
    zero = torch.zeros((), dtype=trainer.dtype, device=trainer.device)
    diff = torch.nan_to_num(torch.where(real, trainer - sampler, zero), nan=0.0)
    if mode in SEQUENCE_MODES:
        raw = torch.exp(diff.sum(-1, keepdim=True))
        counted = real.any(-1, keepdim=True)
    else:
        raw = torch.exp(diff)
        counted = real
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = (raw < low) | (raw > high)
    if mode.endswith("_mask"):
        ratio = raw.masked_fill(outside, 0.0)
    elif clip_min is None and clip_max is None:
        ratio = raw
    else:
        ratio = torch.clamp(raw, min=clip_min, max=clip_max)
    ratio = torch.where(counted, ratio, torch.ones_like(ratio))  # neutral where there is nothing to correct

    values = ratio[counted]
    if values.numel() == 0:
        stats = {name: zero.clone() for name in ("ratio_min", "ratio_mean", "ratio_max", "out_of_bounds_fraction")}
    else:
        stats = {"ratio_min": values.min(), "ratio_mean": values.mean(), "ratio_max": values.max(),
                 "out_of_bounds_fraction": outside[counted].to(ratio.dtype).mean()}
    return ratio, stats


@torch.no_grad()
def check_ratio_shape(ratio: torch.Tensor | None, per_token_logps: torch.Tensor) -> None:
    """A loss's ``importance_sampling_ratio`` is ``[B, T]`` (token modes) or ``[B, 1]`` (sequence modes) for its
    ``[B, T]`` log-probs (None: no correction)."""
    if ratio is not None and (ratio.dim() != 2 or ratio.shape[0] != per_token_logps.shape[0]
                              or ratio.shape[1] not in (1, per_token_logps.shape[1])):
        b, t = per_token_logps.shape
        raise ValueError(f"importance_sampling_ratio must be [B, T] = [{b}, {t}] (token modes) or [B, 1] = [{b}, 1] "
                         f"(sequence modes), got {tuple(ratio.shape)}.")


def sampling_mismatch(trainer_logps: torch.Tensor, sampling_logps: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the trainer's on the sampled tokens (detached scalars).

    Over the real tokens (``mask`` nonzero) whose difference ``r_t = trainer_t - sampler_t`` is not NaN (NaN: the
    sampler could not score the token; left out rather than counted as 0, which would understate the gap):

      - ``logp_difference_mean``, ``logp_difference_max``: mean and max of ``|r_t|`` (TRL's
        ``sampling/sampling_logp_difference/mean`` and ``/max``);
      - ``kl``: the k3 estimate of ``KL(pi_sampler || pi_trainer)``, the mean of ``exp(r_t) - 1 - r_t``. The tokens
        were drawn from the sampler, so with ``x = pi_trainer / pi_sampler = exp(r_t)``, ``E[-log x]`` is that KL
        and ``E[x - 1] = 0``; adding the zero-mean control variate ``x - 1`` keeps the estimate unbiased and makes
        every term non-negative (``x - 1 >= log x``), with lower variance than ``-r_t`` alone (Schulman's k3).

    All three are 0 when no token is counted (an empty mask).
    """
    trainer, sampler, real = _float_pair(trainer_logps, sampling_logps, mask)
    r = trainer - sampler
    r = r[real & ~torch.isnan(r)]
    if r.numel() == 0:
        zero = torch.zeros((), dtype=trainer.dtype, device=trainer.device)
        return {"logp_difference_mean": zero, "logp_difference_max": zero.clone(), "kl": zero.clone()}
    gap = r.abs()
    return {"logp_difference_mean": gap.mean(), "logp_difference_max": gap.max(),
            "kl": (torch.exp(r) - 1 - r).mean().clamp(min=0.0)}
