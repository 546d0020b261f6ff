"""The DPO loss as pure tensor functions: ``dpo_loss`` (the loss types and knobs of TRL's DPOTrainer),
``length_desensitized_logps`` (TRL's ``ld_alpha``, LD-DPO), ``f_divergence_scores`` (TRL's ``f_divergence_type``,
f-DPO), ``wpo_weights`` (TRL's ``use_weighting``, WPO), and the knobs of the loss, ``DPOLossConfig``, checked
once where the module is built."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lightalign.knobs import KnobGroup, knob
from lightalign.modules.losses.implicit_reward import ImplicitRewardKnobs


LOSS_TYPES: tuple[str, ...] = (
    "sigmoid", "hinge", "ipo", "robust", "exo_pair", "bco_pair", "sppo_hard", "nca_pair",
    "aot", "aot_pair", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)
# Loss types whose formula uses label_smoothing; the others ignore it (TRL warns, so do we).
SMOOTHED_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "robust", "exo_pair", "aot", "aot_pair", "aot_unpaired")
F_DIVERGENCE_TYPES: tuple[str, ...] = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# Loss types built on the chosen-minus-rejected score difference: only there does the f-DPO reparameterisation
# cancel the partition function, so only these take a non-default f_divergence_type (as in TRL 1.16).
F_DIVERGENCE_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust",
                                            "discopop", "sft")
# Loss types that sort across the batch: per-pair WPO weights would no longer belong to their pair.
UNWEIGHTABLE_LOSS_TYPES: tuple[str, ...] = ("aot", "aot_pair", "aot_unpaired")


def loss_type_list(loss_type: str | Sequence[str]) -> list[str]:
    """``loss_type`` as a list of names, refusing a name no loss type has (``ValueError`` listing the valid ones)."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    unknown = [t for t in types if t not in LOSS_TYPES]
    if unknown:
        raise ValueError(f"Unknown DPO loss_type {', '.join(map(repr, unknown))}; valid names are: "
                         f"{', '.join(repr(t) for t in LOSS_TYPES)}.")
    return types


def refuse_sorted_weighting(types: Sequence[str]) -> None:
    """Per-pair WPO weights cannot weight the loss types that sort log-ratios across the batch."""
    sorting = [t for t in types if t in UNWEIGHTABLE_LOSS_TYPES]
    if sorting:
        raise ValueError(f"use_weighting=True (WPO) cannot weight loss type(s) {sorting}: they sort log-ratios across "
                         "the batch, so a pair's weight would land on another pair's term. Drop one of the two.")


@dataclasses.dataclass(frozen=True)
class DPOLossConfig(KnobGroup):
    """DPO's loss knobs (TRL's names), checked once here, at construction: ``dpo_loss`` does not check them again.
    Its temperature ``beta`` is ``ImplicitRewardKnobs``' (KTO's too)."""

    group = "loss"
    loss_type: str | list[str] = knob(
        "sigmoid", "one of ``LOSS_TYPES`` or a list of them (combined with ``loss_weights``). ``bco_pair`` subtracts "
                   "the running mean of the rewards (BCO's δ), unlike TRL 1.16, which dropped it: the shift is part "
                   "of BCO's formula (and was in TRL's bco_pair until its DPO refactor).")
    loss_weights: list[float] | None = knob(None, "one weight per loss type (default: all 1.0).")
    label_smoothing: float = knob(
        0.0, "assumed label-noise rate for ``sigmoid``/``robust``/``exo_pair``/``aot*``, in [0, 0.5). On ``sigmoid`` "
             "it gives cDPO, unlike TRL 1.16, which ignores it there (setting it would silently change nothing).")
    reference_free: bool = knob(False, "compare against a uniform reference (log-prob 0): no reference model.")
    ld_alpha: float | None = knob(
        None, "LD-DPO length desensitisation: completion tokens past the shorter completion of the pair weigh "
              "``ld_alpha``, in [0, 1] (``length_desensitized_logps``).")
    f_divergence_type: str = knob(
        "reverse_kl", "f-DPO regulariser: ``reverse_kl`` (default, standard DPO), ``forward_kl``, ``js_divergence`` "
                      "or ``alpha_divergence``; each log-ratio ``log u`` becomes ``f'(u)``. Only for the loss types "
                      "of the chosen-minus-rejected score (sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, "
                      "discopop, sft).")
    f_alpha_divergence_coef: float = knob(0.5, "the ``a`` of ``alpha_divergence`` (score ``(u^(a-1) - 1) / (a - 1)``).")
    use_weighting: bool = knob(
        False, "WPO: weigh each pair's loss by ``w_chosen * w_rejected``, ``w = exp(mean over completion tokens of "
               "log p_t - log sum_v p_v^2)`` under the policy (detached). Not with aot/aot_pair.")
    discopop_tau: float = knob(0.05, "temperature of the ``discopop`` loss, > 0 (the DiscoPOP paper's 0.05).")

    @property
    def loss_types(self) -> list[str]:
        """``loss_type`` as a list of names."""
        return loss_type_list(self.loss_type)

    def check(self) -> None:
        types = self.loss_types
        if not types:
            valid = ", ".join(repr(t) for t in LOSS_TYPES)
            raise ValueError(f"loss_type is empty; give one loss type or a list of them, from: {valid}.")
        weights, label_smoothing = self.loss_weights, self.label_smoothing
        if weights is not None and len(weights) != len(types):
            raise ValueError(
                f"loss_weights has {len(weights)} value(s) but loss_type names {len(types)} loss(es) {types}; "
                "give one weight per loss type, or leave loss_weights unset for all 1.0."
            )
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must lie in [0.0, 0.5), got {label_smoothing}.")
        if "exo_pair" in types and label_smoothing == 0.0:
            raise ValueError("loss_type 'exo_pair' needs label_smoothing > 0 (the EXO paper recommends 1e-3).")
        if self.f_divergence_type not in F_DIVERGENCE_TYPES:
            raise ValueError(f"Unknown f_divergence_type {self.f_divergence_type!r}; valid names are: "
                             f"{', '.join(map(repr, F_DIVERGENCE_TYPES))}.")
        unfit = [t for t in types if t not in F_DIVERGENCE_LOSS_TYPES]
        if self.f_divergence_type != "reverse_kl" and unfit:
            raise ValueError(
                f"f_divergence_type={self.f_divergence_type!r} does not apply to loss type(s) {unfit}: f-DPO only "
                f"holds for the losses of the chosen-minus-rejected score, {list(F_DIVERGENCE_LOSS_TYPES)}. Use "
                "f_divergence_type='reverse_kl' (standard DPO) with these losses."
            )
        if not math.isfinite(self.f_alpha_divergence_coef):
            raise ValueError(f"f_alpha_divergence_coef must be a finite number (default 0.5), got "
                             f"{self.f_alpha_divergence_coef}.")
        if self.use_weighting:
            refuse_sorted_weighting(types)
        if "discopop" in types and not self.discopop_tau > 0:
            raise ValueError(f"discopop_tau must be > 0 (the DiscoPOP paper's 0.05 is the default), got "
                             f"{self.discopop_tau}.")
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha must lie in [0, 1] (1 = plain sums), got {self.ld_alpha}.")
        ignoring = [t for t in types if t not in SMOOTHED_LOSS_TYPES]
        if label_smoothing > 0 and ignoring:
            warnings.warn(
                f"label_smoothing={label_smoothing} is ignored by loss type(s) {ignoring}; it only affects "
                f"{list(SMOOTHED_LOSS_TYPES)}.",
                stacklevel=2,
            )


def validate_loss_config(
    loss_type: str | Sequence[str],
    loss_weights: Sequence[float] | None,
    beta: float,
    label_smoothing: float,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    use_weighting: bool = False,
) -> list[str]:
    """The loss types as a list, once ``DPOLossConfig`` and ``ImplicitRewardKnobs`` have checked these knobs (their
    checks, nothing more): ``ValueError`` saying what to fix."""
    config = DPOLossConfig(loss_type=loss_type, loss_weights=loss_weights, label_smoothing=label_smoothing,
                           f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef,
                           use_weighting=use_weighting)
    ImplicitRewardKnobs(beta=beta)
    return config.loss_types


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (half precision and integers are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def length_desensitized_logps(
    token_logps_chosen: torch.Tensor,
    mask_chosen: torch.Tensor,
    token_logps_rejected: torch.Tensor,
    mask_rejected: torch.Tensor,
    ld_alpha: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probs with LD-DPO length desensitisation (TRL's ``ld_alpha``).

    Inputs are per-token log-probs and 0/1 completion masks, ``[B, T]`` (chosen and rejected may have different
    ``T``). For each pair, the shared length is ``min(len_chosen, len_rejected)``; a completion token counts fully
    when it is among the first ``shared`` completion tokens of its row (by cumulative sum of the mask, so
    completions may start at any offset) and is weighted by ``ld_alpha`` beyond that. ``ld_alpha=1`` gives plain
    sums, ``ld_alpha=0`` keeps only the shared part. Log-probs under a zero mask are never read (they may be -inf).
    TRL applies the same weighting to the reference model's log-probs; do that too by calling this on them.
    ``ld_alpha`` is checked where it is configured (``DPOLossConfig``), not here.
    """
    dtype = _compute_dtype(token_logps_chosen, token_logps_rejected)
    mask_c, mask_r = mask_chosen.bool(), mask_rejected.bool()
    shared = torch.minimum(mask_c.sum(-1), mask_r.sum(-1)).unsqueeze(-1)  # [B, 1]

    def weighted_sum(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        position = mask.long().cumsum(-1)  # 1-based index among completion tokens
        logps = logps.to(dtype)
        zero = torch.zeros((), dtype=dtype, device=logps.device)
        front = torch.where(mask & (position <= shared), logps, zero).sum(-1)
        tail = torch.where(mask & (position > shared), logps, zero).sum(-1)
        return front + ld_alpha * tail

    return weighted_sum(token_logps_chosen, mask_c), weighted_sum(token_logps_rejected, mask_r)


def f_divergence_scores(
    logratios: torch.Tensor, f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 0.5
) -> torch.Tensor:
    """f-DPO: the score ``f'(u)`` of a sequence with likelihood ratio ``u = pi / pi_ref`` (``logratios = log u``).

    ``reverse_kl``: ``log u`` (standard DPO); ``forward_kl``: ``1 - 1/u``; ``js_divergence``: ``log(2u / (1 + u))``;
    ``alpha_divergence``: ``(u^(a-1) - 1) / (a - 1)`` with ``a = f_alpha_divergence_coef`` (``log u`` at ``a = 1``;
    in float32 the exponent is clamped at 80, as TRL does, so the score stays finite).
    """
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":
        a = float(f_alpha_divergence_coef)
        if abs(a - 1.0) < 1e-6:
            return logratios
        exponent = (a - 1.0) * logratios
        if exponent.dtype != torch.float64:
            exponent = exponent.clamp(max=80.0)
        return torch.expm1(exponent) / (a - 1.0)
    raise ValueError(f"Unknown f_divergence_type {f_divergence_type!r}; valid names are: "
                     f"{', '.join(map(repr, F_DIVERGENCE_TYPES))}.")


def wpo_weights(
    token_logps: torch.Tensor, token_log_sum_sq_probs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """WPO pair weights (TRL's ``use_weighting``): ``(chosen_weights [B], rejected_weights [B])``, detached.

    Inputs are ``[2B, T]``, chosen rows first: the policy's per-token log-probs, ``log sum_v p_v^2`` of each token's
    distribution, and the 0/1 completion mask. A sequence weighs ``exp(mean_t (log p_t - log sum_v p_v^2))`` over
    its completion tokens (its probability, length-normalised and aligned to the policy's own sampling
    distribution); ``dpo_loss`` multiplies each pair's terms by ``chosen_weight * rejected_weight``.
    """
    mask = mask.to(torch.float64 if token_logps.dtype == torch.float64 else torch.float32)
    with torch.no_grad():
        aligned = (token_logps.to(mask.dtype) - token_log_sum_sq_probs.to(mask.dtype)) * mask
        weights = torch.exp(aligned.sum(-1) / mask.sum(-1).clamp(min=1.0))
    half = weights.shape[0] // 2
    return weights[:half], weights[half:]


def _smoothed_sigmoid(x: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    *,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    reference_free: bool = False,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    bco_delta: torch.Tensor | float = 0.0,
    discopop_tau: float = 0.05,
    chosen_token_logp_sums: torch.Tensor | None = None,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    pair_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-example DPO losses (TRL's loss types) from summed completion log-probs.

    All log-prob tensors are ``[B]`` sums over completion tokens; ``ref_*`` may be ``None`` when
    ``reference_free`` (reference log-probs are then 0). Several loss types may be combined: the result is
    ``sum_k loss_weights[k] * loss_k`` (weights default to 1). Computation is in float32 (float64 if an input is
    float64). Notes per type:

    - ``ipo`` divides both log-ratios by the completion lengths (``chosen_lengths``/``rejected_lengths``,
      clamped to >= 1), as TRL does; only the ipo term sees the normalised values.
    - ``sft`` is TRL's mean token NLL over all chosen tokens of the batch: example ``i`` gets
      ``-policy_chosen_logps[i] / mean(chosen_lengths)``, so ``losses.mean()`` equals
      ``sum(NLL) / sum(chosen_lengths)`` exactly. The NLL is of the plain per-token log-probs: when the other
      terms get length-desensitised sums (``ld_alpha``), pass the plain sums as ``chosen_token_logp_sums``
      (TRL 1.16 does the same: its sft term reads the unweighted per-token log-probs).
    - ``bco_pair`` subtracts ``bco_delta``, a running mean of rewards that the caller keeps. To follow TRL's
      original scheme, update the running mean with ``beta * cat([chosen - ref_chosen, rejected - ref_rejected])
      .mean()`` of the current batch *before* calling, then pass it; ``0.0`` (default) matches TRL 1.16,
      which dropped the running mean. ``DPOModule`` passes the running mean: deliberately unlike TRL 1.16,
      because the shift δ is part of BCO's formula (and of TRL's own bco_pair until its DPO refactor).
    - ``aot`` and ``aot_pair`` sort across the batch, so each example's loss depends on the others.
      ``aot_unpaired`` is TRL 1.16's name for ``aot_pair`` (same formula; both names are accepted).
    - ``sigmoid_norm`` is ``sigmoid`` on length-normalised scores (``chosen_lengths``/``rejected_lengths``).
    - ``f_divergence_type`` (f-DPO) replaces each log-ratio ``log u`` by the score ``f'(u)``
      (``f_divergence_scores``) in sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust and discopop; sft does
      not read it; the other types refuse a non-default value (``validate_loss_config``). Rewards stay
      ``beta * log u``.
    - ``pair_weights`` ``[B]`` (WPO, TRL's ``use_weighting``: ``chosen_weight * rejected_weight`` from
      ``wpo_weights``) multiplies every term of a pair; the ``sft`` term is then, as in TRL, the batch's token
      NLL times each pair's weight.
    - ``label_smoothing`` (cDPO / robust DPO / EXO epsilon) affects sigmoid, robust, exo_pair, aot, aot_pair.
      Deliberately unlike TRL 1.16, ``sigmoid`` applies it (cDPO: ``-(1-e) logsig(x) - e logsig(-x)``), because
      TRL 1.16 ignores it there without a word, so a user who sets it would silently train plain DPO;
      ``label_smoothing=0`` (the default) equals TRL.

    The knobs (``beta``, ``label_smoothing``, ``loss_weights``, ``f_divergence_*``, ``discopop_tau``) are checked
    once, where they are configured (``DPOLossConfig`` and ``ImplicitRewardKnobs``, built with ``DPOModule``), not
    here.

    Returns ``(losses [B], chosen_rewards [B], rejected_rewards [B])``, rewards being
    ``beta * (policy - reference)`` detached.
    """
    types = loss_type_list(loss_type)  # the names the dispatch below knows; the knobs' values are not re-checked
    if pair_weights is not None:
        refuse_sorted_weighting(types)
    weights = [1.0] * len(types) if loss_weights is None else [float(w) for w in loss_weights]

    if reference_free:
        refs: tuple[torch.Tensor, ...] = ()
    elif ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError("ref_chosen_logps and ref_rejected_logps are None: pass reference log-probs or set "
                         "reference_free=True.")
    else:
        refs = (ref_chosen_logps, ref_rejected_logps)
    dtype = _compute_dtype(policy_chosen_logps, policy_rejected_logps, *refs)
    device = policy_chosen_logps.device
    pc = policy_chosen_logps.to(dtype)
    pr = policy_rejected_logps.to(device=device, dtype=dtype)
    if pc.dim() != 1 or pr.shape != pc.shape or any(r.shape != pc.shape for r in refs):
        raise ValueError("dpo_loss expects 1-D [batch] log-prob tensors of one shape; got "
                         f"{[tuple(t.shape) for t in (policy_chosen_logps, policy_rejected_logps, *refs)]}.")
    if reference_free:
        rc = rr = torch.zeros_like(pc)
    else:
        rc, rr = (r.to(device=device, dtype=dtype) for r in refs)

    def lengths(value: torch.Tensor | None, name: str, needed_by: str) -> torch.Tensor:
        if value is None:
            raise ValueError(f"loss_type {needed_by!r} needs {name} (completion token counts per example, [B]).")
        return torch.as_tensor(value, device=device).to(dtype).clamp(min=1.0)

    chosen_logratios, rejected_logratios = pc - rc, pr - rr
    chosen_scores = f_divergence_scores(chosen_logratios, f_divergence_type, f_alpha_divergence_coef)
    rejected_scores = f_divergence_scores(rejected_logratios, f_divergence_type, f_alpha_divergence_coef)
    logits = beta * (chosen_scores - rejected_scores)
    eps = label_smoothing
    losses = torch.zeros_like(pc)
    for name, weight in zip(types, weights):
        if name == "sigmoid":
            term = _smoothed_sigmoid(logits, eps)
        elif name == "hinge":
            term = torch.relu(1 - logits)
        elif name == "ipo":
            len_c = lengths(chosen_lengths, "chosen_lengths", "ipo")
            len_r = lengths(rejected_lengths, "rejected_lengths", "ipo")
            term = (chosen_scores / len_c - rejected_scores / len_r - 1 / (2 * beta)) ** 2
        elif name == "robust":
            term = (-(1 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)
        elif name == "exo_pair":
            term = torch.sigmoid(logits) * (F.logsigmoid(logits) - math.log1p(-eps)) + torch.sigmoid(-logits) * (
                F.logsigmoid(-logits) - math.log(eps)
            )
        elif name == "bco_pair":
            delta = torch.as_tensor(bco_delta, device=device).to(dtype).detach()
            term = -F.logsigmoid(beta * chosen_logratios - delta) - F.logsigmoid(-(beta * rejected_logratios - delta))
        elif name == "sppo_hard":
            term = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        elif name == "nca_pair":
            chosen_r, rejected_r = beta * chosen_logratios, beta * rejected_logratios
            term = -F.logsigmoid(chosen_r) - 0.5 * F.logsigmoid(-chosen_r) - 0.5 * F.logsigmoid(-rejected_r)
        elif name == "aot":
            delta = torch.sort(pc - pr).values - torch.sort(rc - rr).values
            term = _smoothed_sigmoid(beta * delta, eps)
        elif name in ("aot_pair", "aot_unpaired"):
            delta = torch.sort(chosen_logratios).values - torch.sort(rejected_logratios).values
            term = _smoothed_sigmoid(beta * delta, eps)
        elif name == "apo_zero":
            term = (1 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)
        elif name == "apo_down":
            term = torch.sigmoid(beta * chosen_logratios) + (1 - torch.sigmoid(logits))
        elif name == "discopop":
            mix = torch.sigmoid(logits / discopop_tau)
            term = (1 - mix) * -F.logsigmoid(logits) + mix * torch.exp(-logits)
        elif name == "sigmoid_norm":
            len_c = lengths(chosen_lengths, "chosen_lengths", "sigmoid_norm")
            len_r = lengths(rejected_lengths, "rejected_lengths", "sigmoid_norm")
            term = -F.logsigmoid(beta * (chosen_scores / len_c - rejected_scores / len_r))
        else:  # "sft"
            nll_logps = pc if chosen_token_logp_sums is None else chosen_token_logp_sums.to(device=device, dtype=dtype)
            term = -nll_logps / lengths(chosen_lengths, "chosen_lengths", "sft").mean()
            if pair_weights is not None:  # TRL: the batch's token NLL, weighted per pair
                term = term.mean().expand_as(pc)
        if pair_weights is not None:
            term = term * pair_weights.to(device=device, dtype=dtype).detach()
        losses = losses + weight * term

    chosen_rewards = (beta * chosen_logratios).detach()
    rejected_rewards = (beta * rejected_logratios).detach()
    return losses, chosen_rewards, rejected_rewards
