"""``KTOModule``: Kahneman-Tversky optimisation on the unpaired batches of ``UnpairedPreferenceDataModule``, wired
to a policy and its reference (the loss itself is the pure function ``kto_loss``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightalign.knobs import takes_knobs
from lightalign.modules.training.lora import is_peft_model
from lightalign.modules.training.policy import PolicyModule
from lightalign.modules.training.neftune import NEFTuneKnobs
from lightalign.modules.losses.implicit_reward import ImplicitRewardKnobs
from lightalign.modules.losses.kto import (LOSS_TYPES, KTOLossConfig, kl_estimate, kto_loss,  # noqa: F401
                                           validate_kto_config)
from lightalign.modules.training.logprobs import completion_logps
from lightalign.modules.reference.component import Reference, ReferenceKnobs, SharedLayersKnobs
from lightalign.modules.reference.model import model_fingerprint
from lightalign.modules.reference.precompute import PrecomputeReferenceKnobs, precompute_reference_logps
from lightalign.modules.reference.bema import BEMAKnobs
from lightalign.modules.reference.sync import PRECOMPUTED, ReferenceSyncKnobs, quantized_reference
from lightalign.modules.training.stat_hooks import StatHooks
from lightalign.vision.inputs import model_inputs

# The tokenized columns a reference log-prob depends on (with their row order): the cache key hashes them.
TOKENIZED_COLUMNS = ("prompt_input_ids", "completion_input_ids", "kl_completion_input_ids", "index")
# name -> which rows it averages over ("all", "desirable", "undesirable")
STATS = {"loss": "all", "kl": "all", "rewards/chosen": "desirable", "rewards/rejected": "undesirable",
         "logps/chosen": "desirable", "logps/rejected": "undesirable"}


def balance_warning(desirable: int, undesirable: int, desirable_weight: float, undesirable_weight: float) -> str | None:
    """TRL's check of the class balance (from Eq. 8 of the KTO paper): with unequal counts, EITHER
    ``desirable_weight`` should lie in ``[u*w_u/d, 1.33*u*w_u/d]`` OR ``undesirable_weight`` in
    ``[d*w_d/u/1.33, d*w_d/u]`` (bounds rounded to 2 decimals). The warning, or None."""
    if desirable == undesirable:
        return None
    d_low, d_high = round(undesirable * undesirable_weight / desirable, 2), round(
        undesirable * undesirable_weight / desirable * 1.33, 2)
    u_low, u_high = round(desirable * desirable_weight / undesirable / 1.33, 2), round(
        desirable * desirable_weight / undesirable, 2)
    if d_low <= desirable_weight <= d_high or u_low <= undesirable_weight <= u_high:
        return None
    return (f"The training data has {desirable} desirable and {undesirable} undesirable rows, and desirable_weight="
            f"{desirable_weight}, undesirable_weight={undesirable_weight} are outside the range the KTO paper "
            f"recommends (Eq. 8). Set EITHER desirable_weight in [{d_low}, {d_high}] OR undesirable_weight in "
            f"[{u_low}, {u_high}] (not both).")


def sequence_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
    """Summed completion log-probs ``[N]`` of the padded sequences ``{prefix}input_ids`` (one forward), with their
    image inputs (``model_inputs``: the mismatched ``kl_`` sequences carry their own prompts' images)."""
    ids = batch[f"{prefix}input_ids"]
    logits = model(input_ids=ids, attention_mask=batch[f"{prefix}attention_mask"], use_cache=False,
                   **model_inputs(batch, prefix)).logits
    token_logps, _ = completion_logps(logits, ids, batch[f"{prefix}completion_mask"])
    return token_logps.sum(-1)


@takes_knobs(NEFTuneKnobs, ReferenceSyncKnobs, BEMAKnobs, ImplicitRewardKnobs, KTOLossConfig, ReferenceKnobs, SharedLayersKnobs, PrecomputeReferenceKnobs,
             defaults={"disable_dropout": True})
class KTOModule(StatHooks, PolicyModule):
    """KTO (Ethayarajh et al. 2024) on completions judged one at a time (``UnpairedPreferenceDataModule``).

    Each micro-batch runs the policy on its rows (with gradients) and on its mismatched sequences (each prompt with
    another row's completion, no gradients), and the reference on both. The KL estimate ``z`` is the mean
    policy/reference log-ratio of the mismatched sequences, averaged over the ranks, clamped at 0 and detached (TRL
    1.16). The loss is the mean over the micro-batch's rows of ``w_d * (1 - sigmoid(beta * (r - z)))`` (desirable)
    and ``w_u * (1 - sigmoid(beta * (z - r)))`` (undesirable), ``r`` the row's log-ratio.

    Logged per optimizer step (``train/``) and per validation epoch (``val/``), as TRL names them: ``loss``,
    ``kl``, ``rewards/chosen`` and ``logps/chosen`` (desirable rows), ``rewards/rejected`` and ``logps/rejected``
    (undesirable rows), ``rewards/margins`` (chosen minus rejected); torchmetrics, each averaged over the rows it
    describes across accumulation and ranks (``kl`` over micro-batches, weighted by rows). ``eval_metrics`` receive
    ``sigmoid(reward)`` of each row and its label as the target.

    Its knobs: the loss's (``KTOLossConfig``, with ``ImplicitRewardKnobs``' ``beta``), the reference's
    (``ReferenceKnobs``, ``SharedLayersKnobs``, ``PrecomputeReferenceKnobs``) and ``PolicyModule``'s;
    ``disable_dropout`` defaults to on (TRL 1.16's default for KTO). With LoRA (``peft_config``) and no
    ``ref_model_name_or_path``, the reference is the base model with the adapters disabled: no second copy in memory.
    """

    takes_images = True  # rows with images: every forward reads them (tests/vision)

    method_name = "KTO"
    logged_stats = STATS
    uses_reference_model = True

    def check_knob_combinations(self) -> None:
        super().check_knob_combinations()
        self.knobs.implicit_reward.check_single(type(self).__name__)

    def reference_sync_blocker(self) -> str | None:
        knobs = self.knobs
        if knobs.precompute_reference.precompute_ref_log_probs:
            return PRECOMPUTED
        return super().reference_sync_blocker() or quantized_reference(knobs.reference.ref_model_init_kwargs)

    def compose(self) -> None:
        super().compose()
        self.reference = Reference.from_knobs(self.knobs.reference, self.knobs.shared_layers)
        self.reference_forward_calls = 0
        self.build_stat_metrics()

    @property
    def uses_kl(self) -> bool:
        return self.knobs.loss.loss_type == "kto"

    # ------------------------------------------------------------------------------------- data checks
    def setup(self, stage: str) -> None:
        """Before any model is built: the datamodule must be an unpaired one, with micro-batches of 2+ rows for
        the KL estimate; warn when the class balance and the weights are outside TRL's recommended range."""
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None:
            return
        if not hasattr(datamodule, "label_counts"):
            raise ValueError(f"KTOModule trains on UnpairedPreferenceDataModule batches, not {type(datamodule).__name__}: "
                             "set data.class_path: lightalign.UnpairedPreferenceDataModule (it also takes paired rows).")
        if self.uses_kl and datamodule.batch_size < 2:
            raise ValueError(f"data.batch_size={datamodule.batch_size}: the kto loss estimates its KL term from the other "
                             "rows of a micro-batch, so it needs at least 2 rows per micro-batch. Raise data.batch_size "
                             "(use trainer.accumulate_grad_batches for memory), or use loss_type: apo_zero_unpaired.")
        if stage == "fit" and "train" in datamodule.label_counts:
            loss = self.knobs.loss
            message = balance_warning(*datamodule.label_counts["train"], loss.desirable_weight, loss.undesirable_weight)
            if message:
                rank_zero_warn(message)

    # ------------------------------------------------------------------------------------- reference
    def configure_model(self) -> None:
        super().configure_model()
        if self.ref_model is not None or getattr(self, "_ref_released", False):
            return
        separate = self.reference.separate or self.reference.num_shared_layers
        fresh_fit = (self._trainer is not None and self.trainer.ckpt_path is None
                     and self.trainer.state.fn == "fit")  # not `lightalign test` of a trained checkpoint
        if (self.knobs.precompute_reference.precompute_ref_log_probs and not separate and fresh_fit
                and not is_peft_model(self.model)):
            self._policy_is_reference = True  # the untrained policy is the reference of the one precompute pass
            return
        with torch.inference_mode(False):
            self.ref_model = self.reference.build(self.model, self.model_name_or_path,
                                                  self.knobs.model.trust_remote_code)

    @torch.no_grad()
    def reference_logps(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reference log-probs of the rows and of their mismatched sequences (None without a KL term)."""
        if "ref_logps" in batch:
            return batch["ref_logps"], batch.get("ref_kl_logps") if self.uses_kl else None
        self.reference_forward_calls += 1
        with self.reference.model_for(self.ref_model, self.model, getattr(self, "_policy_is_reference", False)) as ref:
            return self._logps_pair(ref, batch)

    def _logps_pair(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        kl = sequence_logps(model, batch, "kl_") if self.uses_kl else None
        return sequence_logps(model, batch), kl

    # ------------------------------------------------------------------------------------- step
    def kl_term(self, batch: dict[str, torch.Tensor], ref_kl_logps: torch.Tensor | None) -> torch.Tensor:
        """The detached KL estimate of this micro-batch, averaged over the ranks and clamped at 0 (0 without)."""
        if not self.uses_kl:
            return torch.zeros((), device=batch["input_ids"].device)
        with torch.no_grad():
            kl = kl_estimate(sequence_logps(self.model, batch, "kl_"), ref_kl_logps)
        return self.mean_over_ranks(kl).clamp(min=0)

    def mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the ranks (every rank calls it at the same step)."""
        if self._trainer is not None and self.trainer.world_size > 1:
            return self.trainer.strategy.reduce(value, reduce_op="mean")
        return value

    def _step(self, batch: dict[str, torch.Tensor], stats: torch.nn.ModuleDict) -> torch.Tensor:
        ref_logps, ref_kl_logps = self.reference_logps(batch)
        kl = self.kl_term(batch, ref_kl_logps)
        policy_logps = sequence_logps(self.model, batch)
        labels = batch["labels"]
        knobs = self.knobs.loss
        loss, out = kto_loss(policy_logps, ref_logps, labels, kl, beta=self.knobs.implicit_reward.beta,
                             desirable_weight=knobs.desirable_weight, undesirable_weight=knobs.undesirable_weight,
                             loss_type=knobs.loss_type)
        logps = policy_logps.detach().float()
        groups = {"all": torch.ones_like(labels), "desirable": labels, "undesirable": ~labels}
        values = {"loss": out["losses"], "kl": kl.expand(labels.shape[0]), "rewards/chosen": out["rewards"],
                  "rewards/rejected": out["rewards"], "logps/chosen": logps, "logps/rejected": logps}
        for key, group in STATS.items():
            rows = groups[group]
            count = rows.sum()
            mean = values[key][rows].sum() / count.clamp(min=1)
            stats[key.replace("/", "_")].update(mean, weight=count.float())  # weight 0 when no such rows
        if stats is self.eval_stats and (self.eval_metric_objects or self.eval_metric_fns):
            self.update_eval_metrics(torch.sigmoid(out["rewards"]), labels.long())
        return loss

    def _log_stats(self, stats: torch.nn.ModuleDict, stage: str) -> None:
        computed = {}
        for key in STATS:
            metric = stats[key.replace("/", "_")]
            computed[key] = float(metric.compute())  # 0/0 = nan when no row of that kind was seen
            metric.reset()
        computed["rewards/margins"] = computed["rewards/chosen"] - computed["rewards/rejected"]
        for key, value in computed.items():
            if not math.isnan(value):
                self.log(f"{stage}/{key}", value, prog_bar=key in ("loss", "kl"))

    # ------------------------------------------------------------------------------------- hooks
    def on_fit_start(self) -> None:
        self.check_model_layout()  # before the reference pass: a refused layout costs no compute
        self.reference.move(self.ref_model, self.device, self.model)
        if self.knobs.precompute_reference.precompute_ref_log_probs:
            self.precompute_reference(self.trainer.datamodule)
        self.attach_neftune()  # after the reference pass, which must see clean embeddings

    def on_validation_start(self) -> None:
        self.reference.move(self.ref_model, self.device, self.model)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens = batch["attention_mask"].sum() + (batch["kl_attention_mask"].sum() if self.uses_kl else 0)
        self.last_batch_tokens, self.last_batch_samples = int(tokens), int(batch["labels"].shape[0])
        return self._step(batch, self.train_stats)

    # ------------------------------------------------------------------------------------- precompute
    def reference_fingerprint(self) -> str:
        extra = {"kl": self.uses_kl}
        if self.ref_model is not None or getattr(self, "_policy_is_reference", False):
            return model_fingerprint(self.ref_model if self.ref_model is not None else self.model, extra)
        with self.model.disable_adapter():  # a LoRA policy: its base model is the reference
            return model_fingerprint(self.model.get_base_model(), extra)

    def precompute_reference(self, datamodule: Any) -> None:
        """Give the datamodule the reference log-probs of every row and of its mismatched sequence, per split,
        cached on disk and sharded over the ranks (``precompute_reference_logps``); the reference model is
        released afterwards."""
        precompute_reference_logps(self, datamodule, TOKENIZED_COLUMNS, ("logps", "kl_logps"))
