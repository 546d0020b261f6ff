"""Universal Logit Distillation (ULD; Boizard et al. 2024, "Towards Cross-Tokenizer Distillation: the Universal
Logit Distillation Loss for LLMs") with the extensions of TRL 1.16's ``GOLDTrainer`` (its ``ULDLoss``), as a pure
function of tensors and token lists: ``uld_loss``, configured by ``ULDKnobs``.

Student and teacher have different vocabularies, so their distributions cannot be compared token by token. ULD
compares them as sorted lists: per aligned position, both probability vectors are sorted in decreasing order, the
shorter is padded with zeros, and the loss is the L1 distance ``sum_r |p_(r) - q_(r)|`` (the Wasserstein-1
distance of the two distributions under a uniform cost between distinct tokens), summed over the positions of a
sequence and divided by their number; the batch's loss is the mean over its sequences, times
``uld_distillation_weight``. Probabilities are ``softmax(logits / uld_student_temperature)`` and
``softmax(logits / uld_teacher_temperature)``.

Which positions are compared (per sequence, on the completion tokens; EOS included unless skipped):

* ``uld_skip_student_eos`` / ``uld_skip_teacher_eos``: the last completion token of that side is left out;
* ``use_extended_uld`` (default): the two tokenisations are grouped at their common byte boundaries
  (``token_alignment.align_spans``) and each group's tokens merged into one distribution
  (``token_alignment.merge_groups``), so the ``g``-th distributions of both sides describe the same text; groups
  empty on one side are dropped. Off: the first ``min(n_student, n_teacher)`` positions, paired by position (the
  original paper);
* ``uld_token_merge_strategy``: which logits stand for token ``k``. ``bayesian``: the distribution predicting it;
  ``observed`` (TRL's default): the one at its own position, predicting the next token (TRL's ULD reads these).
  The caller passes each side's logits ``[B, n + 1, V]``, index ``k`` predicting completion token ``k`` and index
  ``n`` the position after the last, and this function picks.

``uld_use_hybrid_loss``: the token strings both vocabularies share (``matched``) are compared directly with GKD's
generalised JSD (``beta``) on the (unnormalised) merged probabilities, floored at 1e-8, averaged over the positions;
the others by the sorted L1 above; weighted ``uld_hybrid_matched_weight`` / ``uld_hybrid_unmatched_weight``, or by
default the matched tokens' share of the teacher's vocabulary and its complement. ``uld_crossentropy_weight`` > 0 adds
the student's cross-entropy on its completion tokens (mean over all of the batch's tokens, untempered logits).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F

from lightalign.knobs import KnobGroup, knob
from lightalign.modules.reference.token_alignment import align_spans, merge_groups

__all__ = ["ULDKnobs", "probability_jsd", "uld_loss"]

ULD_MERGE_STRATEGIES = ("observed", "bayesian")


@dataclasses.dataclass(frozen=True)
class ULDKnobs(KnobGroup):
    """Cross-tokenizer distillation: the ULD loss and the teacher's tokenizer (TRL 1.16 ``GOLDConfig``'s names and
    defaults)."""

    group = "uld"
    use_uld_loss: bool = knob(
        False, "distil with the Universal Logit Distillation loss instead of GKD's JSD: the teacher may have another "
               "tokenizer and vocabulary; it re-tokenises the student's prompt and completion text, and the two "
               "tokenisations are aligned on the text's bytes. Off: ``DistillModule``'s GKD, the teacher's "
               "vocabulary must be the student's.")
    teacher_tokenizer_name_or_path: str | None = knob(
        None, "the teacher's tokenizer (a hub name or folder); default: the teacher's own folder "
              "(``teacher_model_name_or_path``). Needed with a built ``teacher_model``.")
    use_extended_uld: bool = knob(
        True, "align the two tokenisations on their common byte boundaries and merge the distributions of tokens "
              "one side splits (needs byte-level BPE tokenizers on both sides); false: pair the positions in order up "
              "to the shorter side (the original ULD).")
    uld_token_merge_strategy: Literal["observed", "bayesian"] = knob(
        "observed", "``observed``: the logits at each completion token's own position stand for it (they predict "
                    "the next token), and a merged group is its first position's distribution times the later "
                    "tokens' probabilities; ``bayesian``: the logits predicting each token, and a group is its last "
                    "position's distribution times the earlier tokens' probabilities (the chain rule).")
    uld_use_hybrid_loss: bool = knob(
        False, "compare the tokens whose strings both vocabularies have directly (GKD's JSD with ``beta``) and only "
               "the others by sorted probabilities.")
    uld_hybrid_matched_weight: float | None = knob(
        None, "the weight of the hybrid loss's matched-token JSD; null (with ``uld_hybrid_unmatched_weight`` null): "
              "the matched tokens' share of the teacher's vocabulary.")
    uld_hybrid_unmatched_weight: float | None = knob(
        None, "the weight of the hybrid loss's sorted L1 on the other tokens; null (with "
              "``uld_hybrid_matched_weight`` null): one minus the matched share.")
    uld_crossentropy_weight: float = knob(
        0.0, "weight of the student's cross-entropy on the completion tokens added to the loss (0: none).")
    uld_distillation_weight: float = knob(1.0, "weight of the ULD distillation term.")
    uld_student_temperature: float = knob(1.0, "divides the student's logits in the ULD loss.")
    uld_teacher_temperature: float = knob(1.0, "divides the teacher's logits in the ULD loss.")
    uld_skip_student_eos: bool = knob(True, "leave the student's last completion token (its EOS) out of the ULD "
                                            "loss.")
    uld_skip_teacher_eos: bool = knob(True, "leave the teacher's last completion token (the EOS it is given) out of "
                                            "the ULD loss.")

    def check(self) -> None:
        if not self.use_uld_loss:
            unused = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
            if unused:
                verb = "configures" if len(unused) == 1 else "configure"
                raise ValueError(f"{', '.join(unused)} {verb} the ULD loss, which is off: set use_uld_loss: true "
                                 "(distillation across tokenizers), or leave them out.")
        if self.uld_token_merge_strategy not in ULD_MERGE_STRATEGIES:
            raise ValueError(f"uld_token_merge_strategy={self.uld_token_merge_strategy!r} is unknown; use one of "
                             f"{list(ULD_MERGE_STRATEGIES)}.")
        for name in ("uld_crossentropy_weight", "uld_distillation_weight"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        for name in ("uld_student_temperature", "uld_teacher_temperature"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}.")
        matched, unmatched = self.uld_hybrid_matched_weight, self.uld_hybrid_unmatched_weight
        if (matched is None) != (unmatched is None):
            raise ValueError(f"uld_hybrid_matched_weight ({matched}) and uld_hybrid_unmatched_weight ({unmatched}) "
                             "are set together (both numbers) or not at all (both null: weights from the vocabulary "
                             "overlap).")
        if matched is not None and not (matched >= 0.0 and unmatched >= 0.0):
            raise ValueError(f"uld_hybrid_matched_weight and uld_hybrid_unmatched_weight must be >= 0, got {matched} "
                             f"and {unmatched}.")
        if matched is not None and not self.uld_use_hybrid_loss:
            raise ValueError("uld_hybrid_matched_weight / uld_hybrid_unmatched_weight weigh the hybrid loss: set "
                             "uld_use_hybrid_loss: true, or leave them null.")


def probability_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalised JSD (``beta`` 0: KL(teacher || student), 1: KL(student || teacher)) between two sets of
    probability rows ``[n, V]``, not necessarily normalised (floored at 1e-8 before the log), summed and divided by
    ``n`` (at least 1): TRL's ``generalized_jsd_loss(..., logits_are_probs=True)``."""
    log_p = torch.log(student.clamp_min(1e-8))
    log_q = torch.log(teacher.clamp_min(1e-8))
    if beta == 0:
        terms = log_q.exp() * (log_q - log_p)
    elif beta == 1:
        terms = log_p.exp() * (log_p - log_q)
    else:
        b = torch.tensor(beta, dtype=log_p.dtype, device=log_p.device)
        log_m = torch.logaddexp(log_p + torch.log1p(-b), log_q + torch.log(b))
        terms = b * (log_q.exp() * (log_q - log_m)) + (1 - b) * (log_p.exp() * (log_p - log_m))
    return terms.sum() / max(student.shape[0], 1)


def sorted_l1(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """``sum |sort(p) - sort(q)|`` over rows ``[n, Vs]`` / ``[n, Vt]`` sorted in decreasing order, the narrower
    zero-padded: ULD's distance, summed over the rows."""
    p = student.sort(dim=-1, descending=True).values
    q = teacher.sort(dim=-1, descending=True).values
    width = max(p.shape[-1], q.shape[-1])
    return F.l1_loss(F.pad(p, (0, width - p.shape[-1])), F.pad(q, (0, width - q.shape[-1])), reduction="sum")


def hybrid_distance(student: torch.Tensor, teacher: torch.Tensor, matched: tuple[torch.Tensor, torch.Tensor],
                    config: ULDKnobs, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the hybrid loss of one sequence's aligned rows, its matched JSD, its unmatched sorted L1 per row)."""
    teacher_ids, student_ids = (m.to(student.device) for m in matched)
    n = student.shape[0]
    matched_loss = probability_jsd(student[:, student_ids], teacher[:, teacher_ids], beta)
    keep_s = torch.ones(student.shape[-1], dtype=torch.bool, device=student.device)
    keep_t = torch.ones(teacher.shape[-1], dtype=torch.bool, device=teacher.device)
    keep_s[student_ids], keep_t[teacher_ids] = False, False
    unmatched_loss = student.new_zeros(())
    if keep_s.any() and keep_t.any():
        unmatched_loss = sorted_l1(student[:, keep_s], teacher[:, keep_t]) / n
    if config.uld_hybrid_matched_weight is None:
        w_matched = len(teacher_ids) / max(1, teacher.shape[-1])
        w_unmatched = 1.0 - w_matched
    else:
        w_matched, w_unmatched = config.uld_hybrid_matched_weight, config.uld_hybrid_unmatched_weight
    return w_matched * matched_loss + w_unmatched * unmatched_loss, matched_loss, unmatched_loss


def uld_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    student_ids: list[list[int]],
    teacher_ids: list[list[int]],
    student_spans: list[list[tuple[int, int]]] | None,
    teacher_spans: list[list[tuple[int, int]]] | None,
    config: ULDKnobs,
    *,
    beta: float = 0.5,
    matched: tuple[torch.Tensor, torch.Tensor] | None = None,
    student_unpredicted_first: list[bool] | None = None,
    teacher_unpredicted_first: list[bool] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The ULD loss of a batch (see the module docstring) and its parts, detached: ``distillation`` (the mean over
    sequences before the weight), ``crossentropy`` and, with the hybrid loss, ``matched`` / ``unmatched`` (means
    over sequences).

    ``student_logits`` ``[B, Ts + 1, Vs]``, ``teacher_logits`` ``[B, Tt + 1, Vt]``: index ``k`` of a row predicts
    its completion token ``k``, index ``len(ids)`` is the position after the last (untempered). ``student_ids`` /
    ``teacher_ids``: each row's completion tokens (EOS included). ``*_spans``: their byte spans in the completion
    text (``use_extended_uld``; else unused). ``beta``: the hybrid loss's JSD. ``matched``: (teacher ids, student
    ids) the vocabularies share (``matched_vocabulary``; needed with ``uld_use_hybrid_loss``).
    ``student_unpredicted_first`` / ``teacher_unpredicted_first``: rows whose completion starts that side's sequence
    (no logit predicts its first token; index 0 is then unread): on either side, ``bayesian`` leaves the first
    aligned group out; on the student's, the cross-entropy leaves its first token out.
    """
    if config.uld_use_hybrid_loss and matched is None:
        raise ValueError("uld_use_hybrid_loss needs the vocabularies' shared tokens (matched).")
    batch = len(student_ids)
    student_first = student_unpredicted_first or [False] * batch
    unpredicted_first = [s or t for s, t in zip(student_first, teacher_unpredicted_first or [False] * batch)]
    bayesian = config.uld_token_merge_strategy == "bayesian"
    zero = student_logits.sum() * 0.0
    stats: dict[str, torch.Tensor] = {}

    crossentropy = zero
    if config.uld_crossentropy_weight > 0:
        terms, count = [], 0
        for i, ids in enumerate(student_ids):
            first = 1 if student_first[i] else 0
            if len(ids) > first:
                target = torch.tensor(ids[first:], device=student_logits.device)
                terms.append(F.cross_entropy(student_logits[i, first:len(ids)], target, reduction="sum"))
                count += len(ids) - first
        crossentropy = torch.stack(terms).sum() / count if count else zero
        stats["crossentropy"] = crossentropy.detach()

    sizes_s = [len(ids) - int(config.uld_skip_student_eos) for ids in student_ids]
    sizes_t = [len(ids) - int(config.uld_skip_teacher_eos) for ids in teacher_ids]
    if batch == 0 or max(max(sizes_s), max(sizes_t)) <= 0:
        stats["distillation"] = zero.detach()
        return config.uld_crossentropy_weight * crossentropy + zero, stats

    losses, matched_parts, unmatched_parts = [], [], []
    for i in range(batch):
        n_s, n_t, d_s, d_t = sizes_s[i], sizes_t[i], 0, 0
        if n_s <= 0 or n_t <= 0:
            losses.append(zero)
            continue
        if bayesian and unpredicted_first[i]:  # no logit predicts the first tokens: drop the first aligned pair
            if config.use_extended_uld:
                groups_s, groups_t = align_spans(student_spans[i][:n_s], teacher_spans[i][:n_t])
                if not groups_s or not groups_t:
                    losses.append(zero)
                    continue
                d_s, d_t = len(groups_s[0]), len(groups_t[0])
            else:
                d_s = d_t = 1
            n_s, n_t = n_s - d_s, n_t - d_t
            if n_s <= 0 or n_t <= 0:
                losses.append(zero)
                continue
        shift = 0 if bayesian else 1
        p = torch.softmax(student_logits[i, d_s + shift:d_s + shift + n_s] / config.uld_student_temperature, dim=-1)
        q = torch.softmax(teacher_logits[i, d_t + shift:d_t + shift + n_t] / config.uld_teacher_temperature, dim=-1)
        ids_s, ids_t = student_ids[i][d_s:d_s + n_s], teacher_ids[i][d_t:d_t + n_t]
        if config.use_extended_uld:
            groups_s, groups_t = align_spans(student_spans[i][d_s:d_s + n_s], teacher_spans[i][d_t:d_t + n_t])
            pairs = [(gs, gt) for gs, gt in zip(groups_s, groups_t) if gs and gt]
            strategy = config.uld_token_merge_strategy
            p = merge_groups(p, [gs for gs, _ in pairs], ids_s, strategy)
            q = merge_groups(q, [gt for _, gt in pairs], ids_t, strategy)
        else:
            n = min(n_s, n_t)
            p, q = p[:n], q[:n]
        if config.uld_use_hybrid_loss:
            loss, matched_loss, unmatched_loss = hybrid_distance(p, q, matched, config, beta)
            matched_parts.append(matched_loss.detach())
            unmatched_parts.append(unmatched_loss.detach())
        else:
            loss = sorted_l1(p, q) / p.shape[0]
        losses.append(loss)
    distillation = torch.stack(losses).mean()
    stats["distillation"] = distillation.detach()
    if matched_parts:
        stats["matched"] = torch.stack(matched_parts).mean()
        stats["unmatched"] = torch.stack(unmatched_parts).mean()
    return config.uld_crossentropy_weight * crossentropy + config.uld_distillation_weight * distillation, stats
