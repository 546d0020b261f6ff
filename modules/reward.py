"""Reward modelling: ``reward_loss`` (Bradley-Terry, pure tensors) and ``RewardModule`` (a sequence-classification
model with one output trained on the pair batches of ``PreferenceDataModule``).

The trained model scores a sequence with the single logit at its last non-padding token, as transformers'
``*ForSequenceClassification`` models do; its Hugging Face export is what ``GRPOModule(reward_funcs=[folder])``
(through ``RewardModel``) loads.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info

from lightalign.knobs import KnobGroup, knob, takes_knobs
from lightalign.modules.training.lora import is_peft_model
from lightalign.modules.training.policy import PolicyModule
from lightalign.modules.training.neftune import NEFTuneKnobs
from lightalign.modules.training.export import export_hf
from lightalign.modules.training.stat_hooks import StatHooks

PAIR_STATS = ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected")
SCORE_HEADS = ("score", "classifier")  # the head's attribute name in transformers' sequence classifiers


def reward_loss(
    rewards_chosen: torch.Tensor,
    rewards_rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> torch.Tensor:
    """Bradley-Terry loss of a batch of pairs, as TRL 1.16's ``RewardTrainer`` computes it.

    ``mean(-logsigmoid(r_chosen - r_rejected - margin))``, plus, when ``center_rewards_coefficient`` is set,
    ``center_rewards_coefficient * mean((r_chosen + r_rejected) ** 2)`` (pulls the rewards towards mean zero;
    Eisenstein et al. 2023, eq. 2). All tensors are ``[B]``; ``margin`` is the per-pair margin (none: 0).
    Computed in float32 whatever the rewards' dtype.
    """
    chosen, rejected = rewards_chosen.float(), rewards_rejected.float()
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin.to(difference)
    loss = -F.logsigmoid(difference).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    return loss


@dataclasses.dataclass(frozen=True)
class RewardLossKnobs(KnobGroup):
    """The reward model's loss knobs (``reward_loss``)."""

    group = "loss"
    center_rewards_coefficient: float | None = knob(
        None, "weight of the mean-zero penalty on the rewards, ``mean((r_chosen + r_rejected)^2)`` (TRL's name; TRL "
              "recommends 0.01); None: no penalty. Must be >= 0.")

    def check(self) -> None:
        coefficient = self.center_rewards_coefficient
        if coefficient is not None and not coefficient >= 0:
            raise ValueError(f"center_rewards_coefficient must be >= 0 or null (TRL recommends 0.01), got "
                             f"{coefficient}.")


def load_reward_model(name_or_path: str, from_config: bool = False, init_kwargs: dict[str, Any] | None = None,
                      trust_remote_code: bool = False) -> torch.nn.Module:
    """``AutoModelForSequenceClassification`` with ``num_labels=1`` from a folder or hub name.

    A causal LM checkpoint (what most users have) gives its backbone; the score head is then new, initialised at
    random, and a log line says so. ``from_config``: random weights everywhere (the tiny models).
    """
    from transformers import AutoModelForSequenceClassification

    from lightalign.hub import load_model

    info: dict[str, Any] = {}
    model = load_model(AutoModelForSequenceClassification, name_or_path, from_config, init_kwargs, trust_remote_code,
                       config_overrides={"num_labels": 1}, loading_info=None if from_config else info)
    new_head = [k for k in info.get("missing_keys", []) if k.split(".")[0] in SCORE_HEADS]
    if new_head:
        rank_zero_info(f"RewardModule: '{name_or_path}' has no sequence-classification head (a causal LM "
                       f"checkpoint); its backbone is loaded and the score head ({', '.join(sorted(new_head))}) is new, "
                       "initialised at random, and trained with the rest.")
    return model


def score_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The one-output head of a sequence classifier (``score`` or ``classifier``), under a peft wrapper too."""
    base = model.get_base_model() if is_peft_model(model) else model
    for name in SCORE_HEADS:
        head = getattr(base, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    return None


def sequence_classification_peft_config(peft_config: Any) -> Any:
    """The LoRA settings with the score head trainable: a dict gets ``task_type: SEQ_CLS`` (peft then trains and
    saves the head whole, ``modules_to_save``); another task type is refused."""
    if peft_config is None:
        return None
    task = peft_config.get("task_type") if isinstance(peft_config, dict) else getattr(peft_config, "task_type", None)
    task = getattr(task, "value", task)
    if isinstance(peft_config, dict) and task is None:
        return {**peft_config, "task_type": "SEQ_CLS"}
    if task != "SEQ_CLS":
        raise ValueError(f"peft_config.task_type is '{task}', but a reward model is a sequence classifier: use "
                         "task_type SEQ_CLS (or leave it out) so that the score head is trained and exported.")
    return peft_config


@takes_knobs(NEFTuneKnobs, RewardLossKnobs, defaults={"disable_dropout": True})
class RewardModule(StatHooks, PolicyModule):
    """Train a reward model (Bradley-Terry) on the pair batches of ``PreferenceDataModule``.

    The model is ``AutoModelForSequenceClassification`` with one output (``num_labels=1``): ``model_name_or_path``
    may be a causal LM checkpoint (its backbone is loaded and the score head is new, initialised at random; a log
    line says so) or a sequence-classification folder (trained further); ``model`` (Python API) a built sequence
    classifier with ``num_labels=1``. Chosen and rejected sequences go through the model in one forward, padded; a
    sequence's reward is the logit at its last non-padding token, so the model's ``config.pad_token_id`` is set to
    the data tokenizer's pad id. Loss (``reward_loss``, TRL 1.16's): ``mean(-logsigmoid(r_chosen - r_rejected -
    margin))`` with the data's optional per-row ``margin`` column, plus ``center_rewards_coefficient *
    mean((r_chosen + r_rejected)^2)``. The loss is a mean over the pairs of a micro-batch, so accumulating equal
    micro-batches gives the gradient of one big batch.

    Logged per optimizer step (``train/``) and per validation epoch (``val/``, ``test/``): ``loss``, ``accuracy``
    (fraction of pairs with ``r_chosen > r_rejected``), ``margin`` (mean ``r_chosen - r_rejected``),
    ``rewards/chosen``, ``rewards/rejected`` (mean rewards). ``eval_metrics`` receive the Bradley-Terry probability
    ``sigmoid(r_chosen - r_rejected)`` and a target of ones.

    The pairs are batched as padded chosen-then-rejected rows (``PreferenceCollator``): a datamodule with
    ``prompt_sharing`` on is switched to that layout at fit start (a log line says so), since a score is read per
    whole sequence.

    Its knobs: ``RewardLossKnobs`` and ``PolicyModule``'s; ``disable_dropout`` defaults to on (TRL 1.16's default
    for reward models). ``peft_config`` (LoRA): its ``task_type`` defaults to ``SEQ_CLS``, which keeps the score head
    fully trainable and in the export.

    The Hugging Face export (``HFExport``) is a sequence-classification folder (config with ``num_labels: 1`` and
    ``pad_token_id``, weights with the score head, tokenizer) that ``GRPOModule(reward_funcs=[folder])`` and
    ``RewardModel(folder)`` load as it is. With LoRA the export is always merged (``merge_lora`` is implied), so
    the folder never depends on a base model elsewhere.
    """

    method_name = "Reward modelling"
    logged_stats = PAIR_STATS
    progress_stats = ("loss", "accuracy")

    def construct_from_knobs(self, given: dict[str, Any]) -> None:
        """A reward model's LoRA settings train the score head (``sequence_classification_peft_config``): the
        ``peft_config`` given is completed (or refused) before the groups are built and saved."""
        peft_config = sequence_classification_peft_config(given.get("peft_config"))
        super().construct_from_knobs({**given, "peft_config": peft_config})

    def check_knob_combinations(self) -> None:
        super().check_knob_combinations()
        model = self.knobs.model.model
        if model is not None and getattr(getattr(model, "config", None), "num_labels", None) != 1:
            raise ValueError(
                f"RewardModule's model must be a sequence classifier with one output (num_labels=1); the model passed "
                f"has num_labels={getattr(getattr(model, 'config', None), 'num_labels', None)} "
                f"({type(model).__name__}). Build it with AutoModelForSequenceClassification.from_pretrained(..., "
                "num_labels=1), or pass model_name_or_path (a causal LM checkpoint gets a new score head)."
            )

    def compose(self) -> None:
        super().compose()
        self.build_stat_metrics()

    # ------------------------------------------------------------------------------------- model
    def configure_model(self) -> None:
        if self.model is None:
            model = self.knobs.model
            with torch.inference_mode(False):  # validate() before fit() calls this under inference mode
                self.model = load_reward_model(self.model_name_or_path, model.from_config, model.model_init_kwargs,
                                               model.trust_remote_code)
                self._prepare_model()
        self.set_pad_token_id()

    def _prepare_model(self) -> None:
        super()._prepare_model()
        head = score_head(self.model)
        if head is not None and is_peft_model(self.model) and not any(p.requires_grad for p in head.parameters()):
            raise ValueError("With this peft_config the score head is frozen, so the reward model could not learn its "
                             "scale: use task_type SEQ_CLS (or add the head to modules_to_save).")

    def data_tokenizer(self) -> Any:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        return getattr(datamodule, "tokenizer", None)

    def set_pad_token_id(self) -> None:
        """The classifier reads each score at the last token that is not the pad id: it must be the pad id the
        batches are padded with (the data tokenizer's)."""
        config = self.model.config
        tokenizer = self.data_tokenizer()
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            if config.pad_token_id is None:
                raise ValueError("The reward model needs a pad token id (its score is read at the last non-pad "
                                 "token) and neither the data tokenizer nor the model config has one: set the "
                                 "tokenizer's pad_token (e.g. to its eos_token).")
            return
        if config.pad_token_id != pad:
            if config.pad_token_id is not None:
                rank_zero_info(f"RewardModule: the model's pad_token_id {config.pad_token_id} is set to the data "
                               f"tokenizer's, {pad} (the score is read at the last token that is not padding).")
            config.pad_token_id = pad
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        text_config.pad_token_id = pad

    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None)
        if getattr(datamodule, "prompt_sharing", False):
            rank_zero_info("RewardModule: a reward is read per whole sequence, so the pairs are batched as padded "
                           "chosen and rejected rows (data.prompt_sharing switched off).")
            datamodule.prompt_sharing = False

    def batch_layout(self) -> tuple[str, int | None]:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        return "padded", getattr(datamodule, "max_length", None)

    # ------------------------------------------------------------------------------------- forward
    def pair_rewards(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the ``2B`` padded rows (chosen first) -> (rewards of chosen [B], of rejected [B])."""
        if "target_logit_index" in batch or "input_ids" not in batch or batch["input_ids"].shape[0] % 2:
            raise ValueError("RewardModule reads batches of padded chosen-then-rejected rows (PreferenceCollator, "
                             "PreferenceDataModule with prompt_sharing false); this batch has another layout.")
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        rewards = out.logits[:, 0]
        half = rewards.shape[0] // 2
        return rewards[:half], rewards[half:]

    def _step(self, batch: dict[str, torch.Tensor], stats: torch.nn.ModuleDict) -> torch.Tensor:
        chosen, rejected = self.pair_rewards(batch)
        loss = reward_loss(chosen, rejected, batch.get("margin"), self.knobs.loss.center_rewards_coefficient)
        with torch.no_grad():
            chosen, rejected = chosen.detach().float(), rejected.detach().float()
            values = {
                "loss": loss.detach(),
                "accuracy": (chosen > rejected).float().mean(),
                "margin": (chosen - rejected).mean(),
                "rewards/chosen": chosen.mean(),
                "rewards/rejected": rejected.mean(),
            }
            n = float(chosen.shape[0])
            for key, value in values.items():
                stats[key.replace("/", "_")].update(value, weight=n)
            if stats is self.eval_stats and (self.eval_metric_objects or self.eval_metric_fns):
                preference = torch.sigmoid(chosen - rejected)  # Bradley-Terry P(chosen preferred)
                self.update_eval_metrics(preference, torch.ones_like(preference, dtype=torch.long))
        return loss

    # ------------------------------------------------------------------------------------- hooks
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.last_batch_tokens = int(batch["attention_mask"].sum())
        self.last_batch_samples = int(batch["input_ids"].shape[0]) // 2
        return self._step(batch, self.train_stats)

    # ------------------------------------------------------------------------------------- export
    def export_hf(self, output_dir: str | os.PathLike, tokenizer: Any = None, merge_lora: bool = False,
                  state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """The sequence-classification folder; LoRA adapters are always merged into it (``merge_lora`` implied). A
        module not trained yet builds its model first (``configure_model``)."""
        self.configure_model()
        return export_hf(self.model, output_dir, tokenizer=tokenizer, merge_lora=True, state_dict=state_dict)
