"""Distillation losses (GKD and on-policy distillation) as pure functions of tensors.

``generalized_jsd_loss`` is the generalised Jensen-Shannon divergence of GKD (Agarwal et al. 2024, "On-Policy
Distillation of Language Models", eq. 1) between the student's and the teacher's next-token distributions, over the
whole vocabulary, with the conventions of TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` (checked against its
source; its ``DistillationTrainer`` uses the same ones):

* both logits are divided by ``temperature``; ``p = softmax(student / T)``, ``q = softmax(teacher / T)``;
* ``beta = 0``: forward KL ``KL(q || p) = sum_v q (log q - log p)``; ``beta = 1``: reverse KL
  ``KL(p || q) = sum_v p (log p - log q)`` (both ends special-cased, as in TRL: the mixture formula below tends to
  0, not to a KL, as ``beta`` tends to 0 or 1);
* otherwise, with the mixture ``m = (1 - beta) p + beta q`` formed in log space
  (``log m = logaddexp(log p + log(1 - beta), log q + log(beta))``):
  ``beta KL(q || m) + (1 - beta) KL(p || m)``;
* reduction (TRL's ``reduction="batchmean"`` with ``labels``): the per-token divergences summed over the tokens the
  mask keeps (TRL: ``labels != -100``), divided by the number of those tokens (at least 1); with
  ``num_items_in_batch`` (TRL's argument of the same name, the global token count under gradient accumulation) the
  sum is divided by it instead.

Memory: the divergence is computed ``chunk_size`` kept tokens at a time inside one autograd function whose backward
recomputes each chunk and writes the student's gradient (``dKL/ds`` in closed form) straight into one gradient
tensor, so neither pass holds more than a chunk's ``[chunk_size, V]`` float32 intermediates (autograd keeps none of
them); masked positions are never computed. The teacher's logits are detached: the gradient reaches the student only.

On-policy distillation (Thinking Machines, "On-Policy Distillation", 2025; TRL 1.16's ``IWOPDTrainer``,
``distillation_objective="iw_opd"``, whose ``iw_opd_gamma=0`` is the plain method): the student samples, the teacher
scores the sampled tokens, and each token's advantage is ``log q(x_t) - log p(x_t)``, the teacher's minus the
sampler's log-prob of the sampled token, i.e. minus the per-token (single-sample) reverse KL estimate. The loss is
the policy gradient ``-sum_t A_t log p(x_t) / n_tokens`` with ``A`` detached (``on_policy_distillation_loss``); its
gradient is the reverse KL's score-function gradient. IW-OPD additionally weights each token by its share of the
sequence's accumulated ``|A|`` (``on_policy_distillation_advantages``' ``iw_opd_gamma``). Log-probs there come from
the caller, at the temperature it chose (TRL divides both models' logits by ``temperature``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

from lightalign.knobs import KnobGroup, knob

__all__ = ["DISTILL_LOSS_TYPES", "DistillLossKnobs", "check_jsd_beta", "generalized_jsd_loss",
           "on_policy_distillation_advantages", "on_policy_distillation_loss"]

# Tokens per chunk. Peak memory beyond the inputs and the student's gradient is about seven [chunk_size, V] float32
# tensors, whatever the token count, where unchunked autograd grows with the tokens (measured, see
# docs/performance.md 'Distillation loss chunks').
DEFAULT_CHUNK_SIZE = 128
DISTILL_LOSS_TYPES = ("gkd", "on_policy")


def check_jsd_beta(beta: float) -> None:
    """``generalized_jsd_loss``'s ``beta``: a point between forward (0) and reverse (1) KL."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1] (0 = forward KL, 1 = reverse KL, 0.5 = JSD), got {beta}.")


@dataclasses.dataclass(frozen=True)
class DistillLossKnobs(KnobGroup):
    """Distillation's loss and where each batch's completions come from (TRL 1.16 GKD's and IW-OPD's names).
    ``lmbda`` left unset is resolved here, by ``loss_type``."""

    group = "distill_loss"
    loss_type: Literal["gkd", "on_policy"] = knob(
        "gkd", "``gkd``: the generalised Jensen-Shannon divergence over the vocabulary (``beta``); ``on_policy``: the "
               "on-policy reverse-KL signal (per sampled token, teacher minus student log-prob as a detached advantage "
               "of a policy-gradient loss); it trains on the student's own samples only (``lmbda`` 1, no ``seq_kd``).")
    lmbda: float | None = knob(
        None, "the probability that a batch's completions are sampled by the student (TRL's name); otherwise the "
              "teacher samples them (``seq_kd``) or the data's ``completion`` column is used. Drawn once per batch "
              "from torch's RNG (a resumed run draws the same). Default (null): 0.5 (TRL GKD's) for ``gkd``, 1 for "
              "``on_policy``, which refuses any other value.")
    beta: float = knob(
        0.5, "``gkd``: the divergence between forward KL(teacher || student) (0) and reverse KL(student || teacher) "
             "(1); 0.5 is the Jensen-Shannon divergence. Unused by ``on_policy``.")
    seq_kd: bool = knob(False, "when the student does not sample a batch, the teacher samples it (sequence-level KD) "
                               "instead of the data's completions being used.")
    loss_chunk_size: int = knob(DEFAULT_CHUNK_SIZE, "tokens per chunk of the vocabulary-wide divergence (memory only, "
                                                    "not the result).")
    iw_opd_gamma: float = knob(
        0.0, "``on_policy`` only: IW-OPD's weighting (TRL's ``IWOPDConfig.iw_opd_gamma``): each token's advantage "
             "times ``1 + gamma (1 - share of the sequence's accumulated |advantage| before it)``, so the tokens before "
             "the student strays get more weight. 0 is plain on-policy distillation (TRL's ``IWOPDTrainer`` defaults "
             "to 0.5: set that for its IW-OPD).")

    def __post_init__(self) -> None:
        if self.lmbda is None:  # the loss type's default, saved as the run's lmbda
            object.__setattr__(self, "lmbda", 1.0 if self.loss_type == "on_policy" else 0.5)
        super().__post_init__()

    def check(self) -> None:
        if self.loss_type not in DISTILL_LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is unknown; use one of {list(DISTILL_LOSS_TYPES)}.")
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"lmbda is a probability (the share of batches the student samples), got {self.lmbda}.")
        if self.loss_type == "on_policy" and (self.lmbda != 1.0 or self.seq_kd):
            raise ValueError(f"loss_type='on_policy' trains on the student's own samples only: it needs lmbda 1 (got "
                             f"{self.lmbda}) and seq_kd false (got {self.seq_kd}). Use loss_type 'gkd' to distil on "
                             "teacher or dataset completions.")
        check_jsd_beta(self.beta)
        if not 0.0 <= self.iw_opd_gamma < float("inf"):
            raise ValueError(f"iw_opd_gamma must be a finite number >= 0 (0: plain on-policy distillation), got "
                             f"{self.iw_opd_gamma}.")
        if self.iw_opd_gamma and self.loss_type != "on_policy":
            raise ValueError(f"iw_opd_gamma={self.iw_opd_gamma} weights the per-token advantages of loss_type "
                             f"'on_policy'; loss_type {self.loss_type!r} has none. Set loss_type: on_policy, or drop "
                             "iw_opd_gamma.")
        if self.loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size must be >= 1 token, got {self.loss_chunk_size}.")


def _chunk_log_probs(student_rows: torch.Tensor, teacher_rows: torch.Tensor, temperature: float,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(student_rows.dtype, torch.float32)  # float32, or float64 for float64 inputs
    log_p = torch.log_softmax(student_rows.to(dtype) / temperature, dim=-1)
    log_q = torch.log_softmax(teacher_rows.to(dtype) / temperature, dim=-1)
    return log_p, log_q


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """``log((1 - beta) p + beta q)`` without leaving log space."""
    return torch.logaddexp(log_p + math.log1p(-beta), log_q + math.log(beta))


def _chunk_divergence(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-row divergence ``[n]`` of the chunk's distributions ``[n, V]``."""
    if beta == 0.0:
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if beta == 1.0:
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    log_m = _log_mixture(log_p, log_q, beta)
    kl_q_m = (log_q.exp() * (log_q - log_m)).sum(-1)
    kl_p_m = (log_p.exp() * (log_p - log_m)).sum(-1)
    return beta * kl_q_m + (1.0 - beta) * kl_p_m


def _chunk_student_grad(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """``d divergence / d s`` per row ``[n, V]``, ``s`` the student's tempered logits.

    With ``g = dD/dp`` the softmax gives ``dD/ds_j = p_j (g_j - sum_i p_i g_i)``; for the three cases ``g`` is
    ``-q / p`` (so ``p - q``), ``log p - log q + 1`` and ``(1 - beta)(log p - log m)`` (the mixture's own
    dependence on ``p`` cancels the rest).
    """
    p = log_p.exp()
    if beta == 0.0:
        return p - log_q.exp()
    if beta == 1.0:
        gap = log_p - log_q
    else:
        gap = log_p - _log_mixture(log_p, log_q, beta)
    centred = gap - (p * gap).sum(-1, keepdim=True)
    return p * centred if beta == 1.0 else (1.0 - beta) * p * centred


class _SummedGeneralizedJSD(torch.autograd.Function):
    """Sum over the kept tokens of the per-token divergence, chunk by chunk; backward recomputes each chunk."""

    @staticmethod
    def forward(ctx, student_logits, teacher_logits, kept, beta, temperature, chunk_size):
        ctx.save_for_backward(student_logits, teacher_logits, *kept)
        ctx.beta, ctx.temperature, ctx.chunk_size = beta, temperature, chunk_size
        dtype = torch.promote_types(student_logits.dtype, torch.float32)
        total = torch.zeros((), dtype=dtype, device=student_logits.device)
        for start in range(0, kept[0].numel(), chunk_size):
            rows = tuple(i[start:start + chunk_size] for i in kept)
            log_p, log_q = _chunk_log_probs(student_logits[rows], teacher_logits[rows], temperature)
            total += _chunk_divergence(log_p, log_q, beta).sum()
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        student_logits, teacher_logits, *kept = ctx.saved_tensors
        grad = torch.zeros_like(student_logits)
        scale = grad_total / ctx.temperature  # s = logits / T
        for start in range(0, kept[0].numel(), ctx.chunk_size):
            rows = tuple(i[start:start + ctx.chunk_size] for i in kept)
            log_p, log_q = _chunk_log_probs(student_logits[rows], teacher_logits[rows], ctx.temperature)
            grad[rows] = (_chunk_student_grad(log_p, log_q, ctx.beta) * scale).to(grad.dtype)
        return grad, None, None, None, None, None


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """GKD's generalised Jensen-Shannon divergence, averaged over the kept tokens (scalar; TRL 1.16's
    ``GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels, beta, temperature)`` with
    ``mask = labels != -100``; see the module docstring for the formula).

    ``student_logits``/``teacher_logits``: ``[..., V]`` (e.g. ``[B, T, V]``, position ``t`` predicting token
    ``t + 1``; non-contiguous views such as ``logits[:, :-1]`` are read in place), same shape: the teacher must share
    the student's vocabulary. ``mask``: ``[...]``, true/nonzero where the token counts. ``beta`` in ``[0, 1]``:
    0 = forward KL(teacher || student), 1 = reverse KL(student || teacher). ``temperature`` > 0 divides both logits.
    ``chunk_size``: tokens per chunk (memory, not the result). ``num_items_in_batch``: divide the sum by this instead
    of by this call's token count (gradient accumulation over micro-batches of unequal token counts). Logits must be
    finite (as in TRL, a ``-inf`` logit gives NaN).
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"generalized_jsd_loss needs student and teacher logits of one shape, got student "
            f"{tuple(student_logits.shape)} and teacher {tuple(teacher_logits.shape)}; a teacher whose vocabulary "
            "differs from the student's (last dimension) cannot be distilled token by token.")
    if mask.shape != student_logits.shape[:-1]:
        raise ValueError(f"generalized_jsd_loss: mask {tuple(mask.shape)} must have the logits' shape without the "
                         f"vocabulary dimension, {tuple(student_logits.shape[:-1])}.")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}.")
    kept = mask.bool().nonzero(as_tuple=True)
    total = _SummedGeneralizedJSD.apply(student_logits, teacher_logits.detach(), kept, float(beta),
                                        float(temperature), int(chunk_size))
    if num_items_in_batch is None:
        return total / max(kept[0].numel(), 1)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


@torch.no_grad()
def on_policy_distillation_advantages(
    sampler_logps: torch.Tensor,
    teacher_logps: torch.Tensor,
    mask: torch.Tensor,
    iw_opd_gamma: float = 0.0,
    iw_opd_epsilon: float = 1e-8,
) -> torch.Tensor:
    """Per-token advantages ``[N, T]`` of on-policy distillation, detached, 0 where ``mask`` is false.

    ``A_t = teacher_logps_t - sampler_logps_t``: the teacher's minus the student's log-prob of the sampled token
    (minus the per-token reverse-KL estimate; positive where the teacher likes the token more than the student did).
    ``sampler_logps``: the student's log-probs of its sampled tokens (TRL: the rollout's ``rollout_logprobs`` when the
    sampler returned them, else the current student's, detached). Masked positions may hold anything (NaN, -inf).

    ``iw_opd_gamma`` > 0: TRL's IW-OPD weights, per sequence (row)
    ``A_t <- A_t (1 + gamma (1 - sum_{s<t} |A_s| / max(sum_s |A_s|, epsilon)))``, favouring the tokens before
    most of the sequence's teacher-student discrepancy has accumulated (TRL's ``IWOPDConfig`` default is 0.5;
    0 is plain on-policy distillation).
    Raises ``ValueError`` when a kept position has a non-finite teacher log-prob (TRL refuses it too).
    """
    keep = mask.bool()
    missing = keep & ~torch.isfinite(teacher_logps)
    if missing.any():
        raise ValueError(f"on-policy distillation needs the teacher's log-prob of every completion token; "
                         f"{int(missing.sum())} of {int(keep.sum())} are missing (non-finite).")
    zero = torch.zeros((), dtype=teacher_logps.dtype, device=teacher_logps.device)
    advantages = torch.where(keep, teacher_logps - torch.where(keep, sampler_logps, zero), zero)
    if iw_opd_gamma:
        if advantages.dim() != 2:
            raise ValueError(f"iw_opd_gamma weights tokens along each sequence: advantages must be [N, T], got "
                             f"{tuple(advantages.shape)}.")
        size = advantages.abs()
        before = size.cumsum(dim=1) - size
        total = size.sum(dim=1, keepdim=True).clamp_min(iw_opd_epsilon)
        advantages = advantages * (1.0 + iw_opd_gamma * (1.0 - before / total))
    return advantages


def on_policy_distillation_loss(
    per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """``-sum_t A_t log p(x_t) / n`` over the kept tokens (TRL 1.16 ``IWOPDTrainer``'s loss): the policy gradient of
    on-policy distillation, ``A`` from ``on_policy_distillation_advantages`` (detached here too).

    ``per_token_logps``: the student's log-probs of the sampled tokens ``[N, T]`` (with the graph). ``n``: the number
    of kept tokens (at least 1), or ``num_items_in_batch`` when given. Masked positions contribute nothing, whatever
    they hold.
    """
    keep = mask.bool()
    zero = torch.zeros((), dtype=per_token_logps.dtype, device=per_token_logps.device)
    advantages = torch.where(keep, advantages.detach().to(per_token_logps.dtype), zero)  # NaN there: no NaN grad
    terms = torch.where(keep, -per_token_logps * advantages, zero)
    if num_items_in_batch is None:
        return terms.sum() / keep.sum().clamp_min(1)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(terms.device)
    return terms.sum() / num_items_in_batch
