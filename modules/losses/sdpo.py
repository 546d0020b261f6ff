"""SDPO's objective as a pure function: ``(1 - distillation_weight) * policy + distillation_weight * distillation``
(TRL 1.16's ``SDPOTrainer.compute_loss``).

The policy term is GRPO's clipped surrogate on the group-relative advantages (``grpo_loss`` with the method's
``GRPOLossConfig``, no KL term); the distillation term is ``self_distillation_loss`` between the student and the
teacher (the policy shown a successful completion of the group, or feedback) on the completion tokens of the
completions that have a teacher prompt (``self_distillation_mask``), the others contributing 0 to the mean over
completions. At weight 1 the policy term is not computed, at weight 0 the distillation term is not (as TRL).
"""

from __future__ import annotations

import dataclasses

import torch

from lightalign.knobs import KnobGroup, knob
from lightalign.modules.losses.grpo import GRPOLossConfig, grpo_loss
from lightalign.modules.losses.self_distill import SelfDistillLossKnobs, self_distillation_loss
from lightalign.modules.training.logprobs import selective_log_softmax

__all__ = ["SDPOKnobs", "sdpo_loss"]


@dataclasses.dataclass(frozen=True)
class SDPOKnobs(KnobGroup):
    """How SDPO's two objectives mix."""

    group = "sdpo"
    distillation_weight: float = knob(
        1.0, "the loss is ``(1 - w) * policy_loss + w * distillation_loss``: 1 (default) self-distillation only, 0 "
             "GRPO's policy gradient only, between a blend.")

    def check(self) -> None:
        if not 0.0 <= self.distillation_weight <= 1.0:
            raise ValueError(f"distillation_weight must lie in [0, 1], got {self.distillation_weight}.")


def sdpo_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, completion_ids: torch.Tensor,
              completion_mask: torch.Tensor, self_distillation_mask: torch.Tensor, advantages: torch.Tensor,
              old_logps: torch.Tensor | None, *, distillation_weight: float, distill_config: SelfDistillLossKnobs,
              policy_config: GRPOLossConfig, max_completion_length: int | None = None,
              num_items_in_batch: torch.Tensor | float | None = None, loss_scale: float = 1.0,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, stats) of SDPO on a micro-batch.

    ``student_logits`` / ``teacher_logits`` ``[B, T, V]``: the tempered logits predicting each completion token
    (``teacher_logits`` may be None at weight 0); ``self_distillation_mask`` ``[B]``: 1 for a completion with a
    teacher prompt; ``advantages`` ``[B]``; ``old_logps`` ``[B, T]`` or None (on-policy). ``num_items_in_batch`` and
    ``loss_scale`` are ``grpo_loss``'s (the ``dapo``-like types' step token count and the factor the caller
    multiplies the policy term by, so the returned loss already carries it). Stats: ``loss`` (the mix without
    ``loss_scale``, detached), ``policy_loss`` and the clip ratios (weight < 1), ``distillation_loss`` (weight > 0)."""
    loss = student_logits.new_zeros(())
    shown = student_logits.new_zeros(()).detach()
    stats: dict[str, torch.Tensor] = {}
    if distillation_weight > 0.0:
        loss_mask = completion_mask * self_distillation_mask.to(completion_mask.dtype).unsqueeze(1)
        distill, distill_stats = self_distillation_loss(student_logits, teacher_logits, completion_ids, loss_mask,
                                                        distill_config, old_logps=old_logps)
        loss = loss + distillation_weight * distill
        shown = shown + distillation_weight * distill.detach()
        stats.update(distill_stats)
    if distillation_weight < 1.0:
        logps = selective_log_softmax(student_logits, completion_ids)
        policy, policy_stats = grpo_loss(logps, old_logps, advantages, completion_mask, config=policy_config,
                                         max_completion_length=max_completion_length,
                                         num_items_in_batch=num_items_in_batch, loss_scale=loss_scale)
        loss = loss + (1.0 - distillation_weight) * policy * loss_scale
        shown = shown + (1.0 - distillation_weight) * policy.detach()
        stats.update(policy_stats)
    stats["loss"] = shown
    return loss, stats
