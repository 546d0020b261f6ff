"""``DPOModule``: direct preference optimisation wired to a policy and its reference (the loss itself is the pure
function ``dpo_loss``).

Two batch layouts arrive from ``PreferenceDataModule``: the shared-prompt layout (default; each pair is one
``[prompt, chosen, rejected]`` segment, the prompt computed once, logits only where a completion token is
predicted; see ``shared_prefix_batch``) and the classic layout (chosen rows then rejected rows, padded).
"""

from __future__ import annotations

from typing import Any

import torch

from lightalign.modules.training.lora import is_peft_model
from lightalign.modules.training.policy import PolicyModule
from lightalign.modules.training.neftune import NEFTuneKnobs
from lightalign.modules.training.preference_forward import (  # noqa: F401  (re-exported: they were defined here)
    completion_lengths,
    completion_token_logps,
    completion_token_logps_and_alignment,
    pair_batch_layout,
    pair_count,
    real_token_count,
    shared_prompt_layout,
    warn_long_shared_rows,
)
from lightalign.knobs import takes_knobs
from lightalign.modules.losses.dpo import (  # noqa: F401  (re-exported: the public names of the DPO loss)
    F_DIVERGENCE_TYPES,
    LOSS_TYPES,
    SMOOTHED_LOSS_TYPES,
    DPOLossConfig,
    dpo_loss,
    f_divergence_scores,
    length_desensitized_logps,
    validate_loss_config,
    wpo_weights,
)
from lightalign.modules.losses.implicit_reward import ImplicitRewardKnobs
from lightalign.modules.reference.component import Reference, ReferenceKnobs, SharedLayersKnobs
from lightalign.modules.reference.model import model_fingerprint
from lightalign.modules.reference.precompute import PrecomputeReferenceKnobs, precompute_reference_logps
from lightalign.modules.reference.bema import BEMAKnobs
from lightalign.modules.reference.sync import PRECOMPUTED, ReferenceSyncKnobs, quantized_reference
from lightalign.modules.training.stat_hooks import StatHooks

# The tokenized columns a reference log-prob depends on (with their row order): the cache key hashes them.
TOKENIZED_COLUMNS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids", "index")

# ============================================================================================== DPOModule
PAIR_STATS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
              "logps/chosen", "logps/rejected")


@takes_knobs(NEFTuneKnobs, ReferenceSyncKnobs, BEMAKnobs, ImplicitRewardKnobs, DPOLossConfig, ReferenceKnobs, SharedLayersKnobs, PrecomputeReferenceKnobs,
             defaults={"disable_dropout": True})
class DPOModule(StatHooks, PolicyModule):
    """Direct preference optimisation on the pair batches of ``PreferenceDataModule``.

    Chosen and rejected go through the policy in one concatenated forward; per-sequence log-probs sum the
    completion tokens only. Logged per optimizer step (``train/``) and per validation epoch (``val/``):
    ``loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
    ``logps/chosen``, ``logps/rejected``. ``eval_metrics`` receive the implicit preference probability
    ``sigmoid(reward margin)`` and a target of ones.

    Its knobs: the loss's (``DPOLossConfig``, with ``ImplicitRewardKnobs``' ``beta``), the reference's
    (``ReferenceKnobs``, ``SharedLayersKnobs``, ``PrecomputeReferenceKnobs``) and ``PolicyModule``'s;
    ``disable_dropout`` defaults to on, as in TRL (the reference always runs in eval mode). With LoRA
    (``peft_config``) and no ``ref_model_name_or_path``, the reference is the base model with the adapters
    disabled: no second copy in memory.
    """

    takes_images = True  # rows with images: every forward reads them (tests/vision)

    method_name = "DPO"
    logged_stats = PAIR_STATS
    uses_reference_model = True

    def check_knob_combinations(self) -> None:
        super().check_knob_combinations()
        knobs = self.knobs
        knobs.implicit_reward.check_single(type(self).__name__)
        reference = knobs.reference.ref_model_name_or_path
        if knobs.loss.reference_free and (knobs.precompute_reference.precompute_ref_log_probs
                                          or knobs.shared_layers.num_shared_layers or reference):
            raise ValueError("reference_free=True uses no reference model; drop precompute_ref_log_probs, "
                             "num_shared_layers and ref_model_name_or_path.")

    def reference_sync_blocker(self) -> str | None:
        knobs = self.knobs
        if knobs.loss.reference_free:
            return "reference_free=True uses no reference model"
        if knobs.precompute_reference.precompute_ref_log_probs:
            return PRECOMPUTED
        return super().reference_sync_blocker() or quantized_reference(knobs.reference.ref_model_init_kwargs)

    def compose(self) -> None:
        super().compose()
        self.loss_types = self.knobs.loss.loss_types
        self.reference = Reference.from_knobs(self.knobs.reference, self.knobs.shared_layers)
        self.reference_forward_calls = 0
        self.register_buffer("bco_reward_mean", torch.zeros(()), persistent=True)
        self.register_buffer("bco_batches", torch.zeros((), dtype=torch.long), persistent=True)
        self.build_stat_metrics()

    # ------------------------------------------------------------------------------------- reference
    def configure_model(self) -> None:
        super().configure_model()
        if self.ref_model is not None or self.knobs.loss.reference_free or getattr(self, "_ref_released", False):
            return
        if self._policy_can_be_reference():
            # The untrained policy *is* the reference of the one precompute pass: no copy in memory. (Not when
            # resuming: the policy is then restored to trained weights before the pass.)
            self._policy_is_reference = True
            return
        with torch.inference_mode(False):
            self._build_reference()

    def _policy_can_be_reference(self) -> bool:
        separate = self.reference.separate or self.reference.num_shared_layers
        fresh_fit = self._trainer is not None and self.trainer.ckpt_path is None
        return bool(self.knobs.precompute_reference.precompute_ref_log_probs and not separate and fresh_fit
                    and not is_peft_model(self.model))

    def _build_reference(self) -> None:
        self.ref_model = self.reference.build(self.model, self.model_name_or_path, self.knobs.model.trust_remote_code)

    def _move_reference(self) -> None:
        self.reference.move(self.ref_model, self.device, self.model)

    @torch.no_grad()
    def reference_logps(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference log-probs (chosen, rejected) of a pair batch: precomputed, or one reference forward."""
        if "ref_chosen_logps" in batch:
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        if self.knobs.loss.reference_free:
            zeros = torch.zeros(pair_count(batch), dtype=torch.float32, device=batch["input_ids"].device)
            return zeros, zeros
        self.reference_forward_calls += 1
        with self.reference.model_for(self.ref_model, self.model, getattr(self, "_policy_is_reference", False)) as ref:
            return self._pair_logps(ref, batch)

    # ------------------------------------------------------------------------------------- forward
    def _pair_logps(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        """One forward over every pair of the batch -> (chosen_logps [B], rejected_logps [B])."""
        chosen, rejected, _, _ = self._pair_logps_and_chosen_sums(model, batch)
        return chosen, rejected

    def _pair_logps_and_chosen_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                                    weighting: bool = False):
        """(chosen, rejected) as the loss compares them (``ld_alpha``-weighted when set), the plain sums of the
        chosen token log-probs (what the ``sft`` term's NLL reads) and, with ``weighting``, the WPO pair weights
        (else None), from one forward."""
        pair_weights = None
        if weighting:
            token_logps, mask, squares = completion_token_logps_and_alignment(model, batch, alignment=True)
            chosen_w, rejected_w = wpo_weights(token_logps, squares, mask)
            pair_weights = chosen_w * rejected_w
        else:
            token_logps, mask = completion_token_logps(model, batch)
        half = token_logps.shape[0] // 2
        sums = token_logps.sum(-1)
        ld_alpha = self.knobs.loss.ld_alpha
        if ld_alpha is not None:
            chosen, rejected = length_desensitized_logps(token_logps[:half], mask[:half], token_logps[half:],
                                                         mask[half:], ld_alpha)
            return chosen, rejected, sums[:half], pair_weights
        return sums[:half], sums[half:], sums[:half], pair_weights

    def _step(self, batch: dict[str, torch.Tensor], stats: torch.nn.ModuleDict) -> torch.Tensor:
        loss_knobs = self.knobs.loss
        ref_chosen, ref_rejected = self.reference_logps(batch)
        policy_chosen, policy_rejected, chosen_sums, pair_weights = self._pair_logps_and_chosen_sums(
            self.model, batch, weighting=loss_knobs.use_weighting)
        chosen_lengths, rejected_lengths = completion_lengths(batch)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy_chosen, policy_rejected, ref_chosen, ref_rejected,
            beta=self.knobs.implicit_reward.beta, loss_type=self.loss_types, loss_weights=loss_knobs.loss_weights,
            label_smoothing=loss_knobs.label_smoothing, reference_free=loss_knobs.reference_free,
            chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths,
            bco_delta=self._bco_delta(policy_chosen, policy_rejected, ref_chosen, ref_rejected),
            discopop_tau=loss_knobs.discopop_tau, chosen_token_logp_sums=chosen_sums,
            f_divergence_type=loss_knobs.f_divergence_type,
            f_alpha_divergence_coef=loss_knobs.f_alpha_divergence_coef, pair_weights=pair_weights,
        )
        loss = losses.mean()
        n = float(chosen_lengths.shape[0])
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
            rewards = self.knobs.implicit_reward.beta * torch.cat([pc - rc, pr - rr]).float()
            if self.training:
                count = self.bco_batches + 1
                self.bco_reward_mean += (rewards.mean() - self.bco_reward_mean) / count
                self.bco_batches += 1
            return self.bco_reward_mean.clone()

    # ------------------------------------------------------------------------------------- hooks
    def batch_layout(self) -> tuple[str, int | None]:
        return pair_batch_layout(getattr(self.trainer, "datamodule", None) if self._trainer is not None else None)

    def on_fit_start(self) -> None:
        self.check_model_layout()  # before the reference pass: a refused layout costs no compute
        warn_long_shared_rows(getattr(self.trainer, "datamodule", None), self.model)
        self._move_reference()
        if self.knobs.precompute_reference.precompute_ref_log_probs:
            self.precompute_reference(self.trainer.datamodule)
        self.attach_neftune()  # after the reference pass, which must see clean embeddings

    def on_validation_start(self) -> None:
        self._move_reference()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.last_batch_tokens, self.last_batch_samples = real_token_count(batch), pair_count(batch)
        with self.training_forward_context():
            loss = self._step(batch, self.train_stats)
        return self.add_router_aux_loss(loss)

    # ------------------------------------------------------------------------------------- precompute
    def reference_fingerprint(self) -> str:
        extra = {"ld_alpha": self.knobs.loss.ld_alpha}
        if self.ref_model is not None:
            return model_fingerprint(self.ref_model, extra)
        if getattr(self, "_policy_is_reference", False):
            return model_fingerprint(self.model, extra)
        with self.model.disable_adapter():
            return model_fingerprint(self.model.get_base_model(), extra)

    def precompute_reference(self, datamodule: Any) -> None:
        """Give the datamodule the reference log-probs of every split (chosen, rejected), cached on disk and sharded
        over the ranks (``precompute_reference_logps``); the reference model is released afterwards."""
        precompute_reference_logps(self, datamodule, TOKENIZED_COLUMNS, ("chosen", "rejected"))
