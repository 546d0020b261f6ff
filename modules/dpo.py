"""Direct preference optimisation: ``dpo_loss`` (pure tensors; the loss types and knobs of TRL's DPOTrainer),
``length_desensitized_logps`` (TRL's ``ld_alpha``, LD-DPO), and ``DPOModule``, which wires them to a policy and
its reference."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics.aggregation import MeanMetric

from lightalign.modules.base import PolicyModule, is_peft_model
from lightalign.modules.logprobs import completion_logps
from lightalign.modules.reference import (
    build_reference,
    cache_path,
    load_cached,
    model_fingerprint,
    move_reference,
    save_cached,
)

LOSS_TYPES: tuple[str, ...] = (
    "sigmoid", "hinge", "ipo", "robust", "exo_pair", "bco_pair", "sppo_hard", "nca_pair",
    "aot", "aot_pair", "apo_zero", "apo_down", "discopop", "sft",
)
# Loss types whose formula uses label_smoothing; the others ignore it (TRL warns, so do we).
SMOOTHED_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "robust", "exo_pair", "aot", "aot_pair")


def validate_loss_config(
    loss_type: str | Sequence[str],
    loss_weights: Sequence[float] | None,
    beta: float,
    label_smoothing: float,
) -> list[str]:
    """Check the DPO loss knobs and return the loss types as a list; raise ``ValueError`` saying what to fix."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    valid = ", ".join(repr(t) for t in LOSS_TYPES)
    if not types:
        raise ValueError(f"loss_type is empty; give one loss type or a list of them, from: {valid}.")
    unknown = [t for t in types if t not in LOSS_TYPES]
    if unknown:
        raise ValueError(f"Unknown DPO loss_type {', '.join(map(repr, unknown))}; valid names are: {valid}.")
    if loss_weights is not None and len(loss_weights) != len(types):
        raise ValueError(
            f"loss_weights has {len(loss_weights)} value(s) but loss_type names {len(types)} loss(es) {types}; "
            "give one weight per loss type, or leave loss_weights unset for all 1.0."
        )
    if not beta > 0:
        raise ValueError(f"beta must be > 0 (typical values 0.1-0.5), got {beta}.")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0.0, 0.5), got {label_smoothing}.")
    if "exo_pair" in types and label_smoothing == 0.0:
        raise ValueError("loss_type 'exo_pair' needs label_smoothing > 0 (the EXO paper recommends 1e-3).")
    ignoring = [t for t in types if t not in SMOOTHED_LOSS_TYPES]
    if label_smoothing > 0 and ignoring:
        warnings.warn(
            f"label_smoothing={label_smoothing} is ignored by loss type(s) {ignoring}; it only affects "
            f"{list(SMOOTHED_LOSS_TYPES)}.",
            stacklevel=2,
        )
    return types


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
    """
    if not 0.0 <= ld_alpha <= 1.0:
        raise ValueError(f"ld_alpha must lie in [0.0, 1.0] (1.0 = plain sums), got {ld_alpha}.")
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
      ``sum(NLL) / sum(chosen_lengths)`` exactly.
    - ``bco_pair`` subtracts ``bco_delta``, a running mean of rewards that the caller keeps. To follow TRL's
      original scheme, update the running mean with ``beta * cat([chosen - ref_chosen, rejected - ref_rejected])
      .mean()`` of the current batch *before* calling, then pass it; ``0.0`` (default) matches current TRL,
      which dropped the running mean.
    - ``aot`` and ``aot_pair`` sort across the batch, so each example's loss depends on the others.
    - ``label_smoothing`` (cDPO / robust DPO / EXO epsilon) affects sigmoid, robust, exo_pair, aot, aot_pair.

    Returns ``(losses [B], chosen_rewards [B], rejected_rewards [B])``, rewards being
    ``beta * (policy - reference)`` detached.
    """
    types = validate_loss_config(loss_type, loss_weights, beta, label_smoothing)
    weights = [1.0] * len(types) if loss_weights is None else [float(w) for w in loss_weights]
    if "discopop" in types and not discopop_tau > 0:
        raise ValueError(f"discopop_tau must be > 0, got {discopop_tau}.")

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
    logits = beta * (chosen_logratios - rejected_logratios)
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
            term = (chosen_logratios / len_c - rejected_logratios / len_r - 1 / (2 * beta)) ** 2
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
        elif name == "aot_pair":
            delta = torch.sort(chosen_logratios).values - torch.sort(rejected_logratios).values
            term = _smoothed_sigmoid(beta * delta, eps)
        elif name == "apo_zero":
            term = (1 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)
        elif name == "apo_down":
            term = torch.sigmoid(beta * chosen_logratios) + (1 - torch.sigmoid(logits))
        elif name == "discopop":
            mix = torch.sigmoid(logits / discopop_tau)
            term = (1 - mix) * -F.logsigmoid(logits) + mix * torch.exp(-logits)
        else:  # "sft"
            term = -pc / lengths(chosen_lengths, "chosen_lengths", "sft").mean()
        losses = losses + weight * term

    chosen_rewards = (beta * chosen_logratios).detach()
    rejected_rewards = (beta * rejected_logratios).detach()
    return losses, chosen_rewards, rejected_rewards


# ============================================================================================== DPOModule
PAIR_STATS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
              "logps/chosen", "logps/rejected")


class DPOModule(PolicyModule):
    """Direct preference optimisation on the pair batches of ``PreferenceDataModule``.

    Chosen and rejected go through the policy in one concatenated forward; per-sequence log-probs sum the
    completion tokens only. Logged per optimizer step (``train/``) and per validation epoch (``val/``):
    ``loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
    ``logps/chosen``, ``logps/rejected``.

    Args:
        beta: strength of the implicit KL penalty (TRL's ``beta``).
        loss_type: one of ``LOSS_TYPES`` or a list of them (combined with ``loss_weights``).
        loss_weights: one weight per loss type.
        label_smoothing: assumed label-noise rate for ``sigmoid``/``robust``/``exo_pair``/``aot*``.
        reference_free: compare against a uniform reference (log-prob 0): no reference model.
        ld_alpha: LD-DPO length desensitisation (tokens past the shorter completion weigh ``ld_alpha``).
        discopop_tau: temperature of the ``discopop`` loss.
        ref_model_name_or_path: the reference checkpoint (default: a frozen copy of the initial policy).
        ref_model_init_kwargs: ``from_pretrained`` kwargs of the reference, e.g.
            ``{quantization_config: {load_in_8bit: true}}`` (bitsandbytes) or ``{dtype: bfloat16}``.
        num_shared_layers: share the first k decoder layers (and the embeddings) between policy and reference;
            they are frozen in both, the rest of the reference is a frozen copy.
        precompute_ref_log_probs: compute the reference log-probs of the train/val data once before training,
            cache them on disk (keyed by reference weights and tokenized data) and free the reference model.
        ref_log_probs_cache_dir: cache folder (default ``$LIGHTALIGN_CACHE/ref_logps`` or
            ``~/.cache/lightalign/ref_logps``).
        **kwargs: ``PolicyModule`` arguments (model, LoRA, optimizer, schedule, ``eval_metrics`` — which receive
            the implicit preference probability ``sigmoid(reward margin)`` and a target of ones).

    With LoRA (``peft_config``) and no ``ref_model_name_or_path``, the reference is the base model with the
    adapters disabled: no second copy in memory.
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        beta: float = 0.1,
        loss_type: str | list[str] = "sigmoid",
        loss_weights: list[float] | None = None,
        label_smoothing: float = 0.0,
        reference_free: bool = False,
        ld_alpha: float | None = None,
        discopop_tau: float = 0.05,
        ref_model_name_or_path: str | None = None,
        ref_model_init_kwargs: dict[str, Any] | None = None,
        num_shared_layers: int | None = None,
        precompute_ref_log_probs: bool = False,
        ref_log_probs_cache_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        loss_types = validate_loss_config(loss_type, loss_weights, beta, label_smoothing)
        if ld_alpha is not None and not 0.0 <= ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha must lie in [0, 1], got {ld_alpha}.")
        if reference_free and (precompute_ref_log_probs or num_shared_layers or ref_model_name_or_path):
            raise ValueError("reference_free=True uses no reference model; drop precompute_ref_log_probs, "
                             "num_shared_layers and ref_model_name_or_path.")
        if num_shared_layers is not None and (ref_model_name_or_path or ref_model_init_kwargs):
            raise ValueError("num_shared_layers shares the policy's own layers; it cannot be combined with a "
                             "separately loaded reference (ref_model_name_or_path / ref_model_init_kwargs).")
        super().__init__(model_name_or_path, **kwargs)
        self.loss_types = loss_types
        self.ref_model: torch.nn.Module | None = None  # not a registered submodule: never optimised or checkpointed
        self.reference_forward_calls = 0
        self.register_buffer("bco_reward_mean", torch.zeros(()), persistent=True)
        self.register_buffer("bco_batches", torch.zeros((), dtype=torch.long), persistent=True)
        self.train_stats = torch.nn.ModuleDict({k.replace("/", "_"): MeanMetric() for k in PAIR_STATS})
        self.eval_stats = torch.nn.ModuleDict({k.replace("/", "_"): MeanMetric() for k in PAIR_STATS})

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "ref_model":  # keep the reference out of the module tree (optimizer, state_dict, DDP)
            self.__dict__[name] = value
            return
        super().__setattr__(name, value)

    # ------------------------------------------------------------------------------------- reference
    def configure_model(self) -> None:
        super().configure_model()
        hp = self.hparams
        if self.ref_model is not None or hp.reference_free or getattr(self, "_ref_released", False):
            return
        with torch.inference_mode(False):
            self._build_reference()

    def _build_reference(self) -> None:
        hp = self.hparams
        self.ref_model = build_reference(
            self.model, hp.ref_model_name_or_path or self.model_name_or_path,
            separate=bool(hp.ref_model_name_or_path or hp.ref_model_init_kwargs),
            init_kwargs=hp.ref_model_init_kwargs, num_shared_layers=hp.num_shared_layers,
            trust_remote_code=hp.trust_remote_code,
        )

    def _move_reference(self) -> None:
        move_reference(self.ref_model, self.device)

    @torch.no_grad()
    def reference_logps(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference log-probs (chosen, rejected) of a pair batch: precomputed, or one reference forward."""
        if "ref_chosen_logps" in batch:
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        if self.hparams.reference_free:
            zeros = batch["input_ids"].new_zeros(batch["input_ids"].shape[0] // 2, dtype=torch.float32)
            return zeros, zeros
        self.reference_forward_calls += 1
        if self.ref_model is None:
            if not is_peft_model(self.model):
                raise RuntimeError("The reference model was released (precomputed log-probs) but this batch has none.")
            with self.model.disable_adapter():
                return self._pair_logps(self.model, batch)
        return self._pair_logps(self.ref_model, batch)

    # ------------------------------------------------------------------------------------- forward
    def _pair_logps(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        """One concatenated forward of the 2B sequences -> (chosen_logps [B], rejected_logps [B])."""
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        token_logps, mask = completion_logps(logits, batch["input_ids"], batch["completion_mask"])
        half = token_logps.shape[0] // 2
        if self.hparams.ld_alpha is not None:
            return length_desensitized_logps(token_logps[:half], mask[:half], token_logps[half:], mask[half:],
                                             self.hparams.ld_alpha)
        sums = token_logps.sum(-1)
        return sums[:half], sums[half:]

    def _step(self, batch: dict[str, torch.Tensor], stats: torch.nn.ModuleDict) -> torch.Tensor:
        hp = self.hparams
        ref_chosen, ref_rejected = self.reference_logps(batch)
        policy_chosen, policy_rejected = self._pair_logps(self.model, batch)
        lengths = batch["completion_mask"][:, 1:].sum(-1)
        half = lengths.shape[0] // 2
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy_chosen, policy_rejected, ref_chosen, ref_rejected,
            beta=hp.beta, loss_type=self.loss_types, loss_weights=hp.loss_weights,
            label_smoothing=hp.label_smoothing, reference_free=hp.reference_free,
            chosen_lengths=lengths[:half], rejected_lengths=lengths[half:],
            bco_delta=self._bco_delta(policy_chosen, policy_rejected, ref_chosen, ref_rejected),
            discopop_tau=hp.discopop_tau,
        )
        loss = losses.mean()
        n = float(half)
        values = {
            "loss": loss.detach(),
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": policy_chosen.detach().mean(),
            "logps/rejected": policy_rejected.detach().mean(),
        }
        for key, value in values.items():
            stats[key.replace("/", "_")].update(value, weight=n)
        if stats is self.eval_stats and (self.eval_metric_objects or self.eval_metric_fns):
            preference = torch.sigmoid(chosen_rewards - rejected_rewards)  # Bradley-Terry P(chosen > rejected)
            self.update_eval_metrics(preference, torch.ones_like(preference, dtype=torch.long))
        return loss

    def _bco_delta(self, pc, pr, rc, rr) -> torch.Tensor | float:
        """bco_pair's running mean of the rewards (updated with this batch first, as TRL did)."""
        if "bco_pair" not in self.loss_types:
            return 0.0
        with torch.no_grad():
            rewards = self.hparams.beta * torch.cat([pc - rc, pr - rr]).float()
            if self.training:
                count = self.bco_batches + 1
                self.bco_reward_mean += (rewards.mean() - self.bco_reward_mean) / count
                self.bco_batches += 1
            return self.bco_reward_mean.clone()

    def _log_stats(self, stats: torch.nn.ModuleDict, stage: str) -> None:
        for key in PAIR_STATS:
            metric = stats[key.replace("/", "_")]
            self.log(f"{stage}/{key}", metric.compute(), prog_bar=key in ("loss", "rewards/accuracies"))
            metric.reset()

    # ------------------------------------------------------------------------------------- hooks
    def on_fit_start(self) -> None:
        self._move_reference()
        if self.hparams.precompute_ref_log_probs:
            self.precompute_reference(self.trainer.datamodule)
        super().on_fit_start()  # NEFTune, when asked: after the reference pass, which must see clean embeddings

    def on_validation_start(self) -> None:
        self._move_reference()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, self.train_stats)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        self._log_stats(self.train_stats, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, self.eval_stats)

    def on_validation_epoch_end(self) -> None:
        self._log_stats(self.eval_stats, "val")
        self.log_eval_metrics("val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, self.eval_stats)

    def on_test_epoch_end(self) -> None:
        self._log_stats(self.eval_stats, "test")
        self.log_eval_metrics("test")

    # ------------------------------------------------------------------------------------- precompute
    def reference_fingerprint(self) -> str:
        hp = self.hparams
        extra = {"ld_alpha": hp.ld_alpha}
        if self.ref_model is not None:
            return model_fingerprint(self.ref_model, extra)
        with self.model.disable_adapter():
            return model_fingerprint(self.model.get_base_model(), extra)

    @torch.no_grad()
    def precompute_reference(self, datamodule: Any) -> None:
        """Give the datamodule the reference log-probs of every split (``set_reference_logps``).

        Values come from the disk cache when the same reference weights met the same tokenized data before;
        otherwise one ordered pass computes and caches them. The reference model is released afterwards.
        """
        fingerprint = None
        was_training = self.training
        self.eval()
        for label, dataset in datamodule.splits().items():
            if label in datamodule.reference_logps:
                continue
            if fingerprint is None:
                fingerprint = self.reference_fingerprint()
            path = cache_path(self.hparams.ref_log_probs_cache_dir, fingerprint, dataset._fingerprint)
            cached = load_cached(path)
            if cached is None:
                chosen, rejected = [], []
                for batch in datamodule.eval_dataloader(dataset, "reference"):
                    batch = {k: v.to(self.device) for k, v in batch.items()}
                    c, r = self.reference_logps(batch)
                    chosen.append(c.float().cpu())
                    rejected.append(r.float().cpu())
                cached = {"chosen": torch.cat(chosen), "rejected": torch.cat(rejected)}
                if self.trainer.is_global_zero:
                    save_cached(path, cached)
            datamodule.set_reference_logps(label, cached["chosen"], cached["rejected"])
        self.train(was_training)
        if self.ref_model is not None:
            self.ref_model = None
            self._ref_released = True
