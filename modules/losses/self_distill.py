"""Self-distillation losses (SDFT, SDPO) as pure functions of tensors: the student's next-token distributions on
its own completions pulled towards the teacher's, the teacher being the policy itself given a richer prompt.

The conventions are TRL 1.16's self-distillation helpers (checked against its source; ``SDFTTrainer`` and
``SDPOTrainer`` share them). Both logits arrive already divided by the sampling temperature (the caller's forward
does it, as TRL's). Per completion token, with ``s`` the student's and ``t`` the teacher's log-probs:

* ``divergence``: ``distillation_alpha = 0`` is the forward KL ``KL(teacher || student)``, ``1`` the reverse
  ``KL(student || teacher)``; in between, with the mixture ``m = (1 - alpha) p_s + alpha p_t`` formed in log space,
  ``alpha KL(teacher || m) + (1 - alpha) KL(student || m)`` (the generalised JSD of GKD, here under the name
  ``distillation_alpha``);
* ``distillation_mode``:
  ``full_logits``: the divergence over the whole vocabulary;
  ``topk_logits``: over the ``distillation_topk`` tokens the *student* ranks highest (the teacher's log-probs read
  at those ids), each side renormalised to sum to 1 over those tokens, or, with ``distillation_add_tail``, kept as
  they are plus one bucket holding the rest of the mass (``1 - sum``);
  ``sampled_token``: the reverse-KL policy gradient on the sampled token only, ``(s - t).detach() * s`` (its gradient
  is the score-function gradient of ``KL(student || teacher)``), which is why it needs ``distillation_alpha = 1``;
* ``distillation_is_clip``: each token's loss times ``min(exp(s - s_old), clip)`` (detached; the log-ratio first
  clamped to [-20, 20]), ``s_old`` the student's log-prob of the token when it was sampled, applied only when the
  caller has those (a rollout trained on after an update);
* reduction: each completion's mean over the tokens of its loss mask (at least 1), then the mean over completions
  (a completion with no kept token counts as 0).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from lightalign.knobs import KnobGroup, knob
from lightalign.modules.training.logprobs import selective_log_softmax

__all__ = ["DISTILLATION_MODES", "SelfDistillLossKnobs", "clipped_importance_weight", "divergence",
           "self_distillation_loss", "self_distillation_per_token", "with_tail_bucket"]

DISTILLATION_MODES = ("sampled_token", "full_logits", "topk_logits")


@dataclasses.dataclass(frozen=True)
class SelfDistillLossKnobs(KnobGroup):
    """The self-distillation loss (TRL 1.16's SDFT and SDPO names; each method states its own defaults)."""

    group = "self_distill_loss"
    distillation_alpha: float = knob(
        0.5, "where the divergence lies between forward KL (0: KL(teacher || student)) and reverse KL (1: "
             "KL(student || teacher)); in between the generalised JSD through their mixture. SDFT's default 0.5; "
             "SDPO's 1.0.")
    distillation_mode: Literal["sampled_token", "full_logits", "topk_logits"] = knob(
        "topk_logits", "what is compared per completion token: ``full_logits`` the whole vocabulary, ``topk_logits`` "
                       "the student's ``distillation_topk`` most likely tokens, ``sampled_token`` the sampled token "
                       "only (a reverse-KL policy gradient; needs distillation_alpha 1). SDFT's default "
                       "``topk_logits``; SDPO's ``sampled_token``.")
    distillation_topk: int | None = knob(
        100, "with ``distillation_mode: topk_logits``, how many of the student's most likely tokens are compared. "
             "SDFT's default 100; SDPO's none (then it must be set for topk_logits).")
    distillation_is_clip: float | None = knob(
        2.0, "each token's loss is weighted by the importance ratio of the current student to the student that "
             "sampled it, clipped above at this value (null: no weight). Acts only on rollouts trained on after an "
             "update (the ratio is 1 otherwise).")
    distillation_add_tail: bool = knob(
        False, "with ``topk_logits``: add one bucket holding the probability mass outside the top k, instead of "
               "renormalising the top k to sum to 1.")

    def check(self) -> None:
        if self.distillation_mode not in DISTILLATION_MODES:
            raise ValueError(f"distillation_mode must be one of {DISTILLATION_MODES}, got {self.distillation_mode!r}.")
        if not 0.0 <= self.distillation_alpha <= 1.0:
            raise ValueError(f"distillation_alpha must lie in [0, 1] (0 forward KL, 1 reverse KL), got "
                             f"{self.distillation_alpha}.")
        if self.distillation_mode == "sampled_token" and self.distillation_alpha != 1.0:
            raise ValueError("distillation_mode 'sampled_token' is the reverse-KL policy gradient on the sampled "
                             f"token, so it needs distillation_alpha 1.0, got {self.distillation_alpha}: set "
                             "distillation_alpha: 1.0 or use topk_logits / full_logits.")
        if self.distillation_mode == "topk_logits" and self.distillation_topk is None:
            raise ValueError("distillation_mode 'topk_logits' compares the student's top-k tokens: set "
                             "distillation_topk (e.g. 100).")
        if self.distillation_topk is not None and self.distillation_topk < 1:
            raise ValueError(f"distillation_topk must be >= 1 or null, got {self.distillation_topk}.")
        if self.distillation_is_clip is not None and self.distillation_is_clip <= 0:
            raise ValueError(f"distillation_is_clip must be > 0 or null (no clipping), got "
                             f"{self.distillation_is_clip}.")


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` per element of the last dimension (not yet summed)."""
    return log_p.exp() * (log_p - log_q)


def divergence(student_logps: torch.Tensor, teacher_logps: torch.Tensor, alpha: float) -> torch.Tensor:
    """The divergence of ``distillation_alpha`` between two log-prob distributions ``[..., K]`` -> ``[...]``."""
    if alpha == 0.0:
        per_entry = _kl(teacher_logps, student_logps)
    elif alpha == 1.0:
        per_entry = _kl(student_logps, teacher_logps)
    else:
        a = torch.tensor(alpha, dtype=student_logps.dtype, device=student_logps.device)
        mixture = torch.logaddexp(student_logps + torch.log1p(-a), teacher_logps + torch.log(a))
        per_entry = alpha * _kl(teacher_logps, mixture) + (1.0 - alpha) * _kl(student_logps, mixture)
    return per_entry.sum(-1)


def with_tail_bucket(logps: torch.Tensor) -> torch.Tensor:
    """Top-k log-probs ``[..., K]`` (summing to the captured mass) plus one entry for the rest: ``[..., K + 1]``."""
    captured = torch.logsumexp(logps, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logps, torch.log(-torch.expm1(captured))], dim=-1)


def _topk_logps(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int, add_tail: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions on the student's top-k token ids, renormalised or with a tail bucket."""
    top_student, ids = torch.topk(student_logits, k=k, dim=-1)
    student = top_student - torch.logsumexp(student_logits, dim=-1, keepdim=True)
    teacher = teacher_logits.gather(-1, ids) - torch.logsumexp(teacher_logits, dim=-1, keepdim=True)
    if add_tail:
        return with_tail_bucket(student), with_tail_bucket(teacher)
    return (student - torch.logsumexp(student, dim=-1, keepdim=True),
            teacher - torch.logsumexp(teacher, dim=-1, keepdim=True))


def clipped_importance_weight(student_logps: torch.Tensor, old_logps: torch.Tensor, clip: float) -> torch.Tensor:
    """``min(exp(s - s_old), clip)``, detached, the log-ratio clamped to [-20, 20] first."""
    log_ratio = (student_logps - old_logps).detach().clamp(min=-20.0, max=20.0)
    return log_ratio.exp().clamp(max=clip)


def self_distillation_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                                completion_ids: torch.Tensor, config: SelfDistillLossKnobs) -> torch.Tensor:
    """The per-token loss ``[B, T]`` of ``config.distillation_mode`` (no importance weight, no mask)."""
    teacher_logits = teacher_logits.detach()
    if config.distillation_mode == "full_logits":
        return divergence(torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1),
                          config.distillation_alpha)
    if config.distillation_mode == "topk_logits":
        student, teacher = _topk_logps(student_logits, teacher_logits, config.distillation_topk,
                                       config.distillation_add_tail)
        return divergence(student, teacher, config.distillation_alpha)
    student = selective_log_softmax(student_logits, completion_ids)
    teacher = selective_log_softmax(teacher_logits, completion_ids)
    return (student - teacher).detach() * student


def self_distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, completion_ids: torch.Tensor,
                           loss_mask: torch.Tensor, config: SelfDistillLossKnobs,
                           old_logps: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, stats) of self-distillation on the completion tokens.

    ``student_logits`` / ``teacher_logits`` ``[B, T, V]``: the logits predicting each completion token (tempered);
    ``loss_mask`` ``[B, T]``: the tokens that count; ``old_logps`` ``[B, T]``: the sampling student's log-probs of
    the tokens, for ``distillation_is_clip`` (None: no weight). Stats: ``distillation_loss`` (the mean per-token loss
    over every kept token of the batch, detached)."""
    per_token = self_distillation_per_token(student_logits, teacher_logits, completion_ids, config)
    if config.distillation_is_clip is not None and old_logps is not None:
        student_logps = selective_log_softmax(student_logits, completion_ids)
        per_token = per_token * clipped_importance_weight(student_logps, old_logps, config.distillation_is_clip)
    mask = loss_mask.to(per_token.dtype)
    masked = per_token * mask
    loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return loss, {"distillation_loss": masked.sum().detach() / mask.sum().clamp(min=1.0)}
