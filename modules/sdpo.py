"""Self-distillation policy optimisation: ``SDPOModule``, GRPO whose teacher is the policy itself shown a
successful completion of the same prompt (Hübotter et al. 2026, "Reinforcement Learning via Self-Distillation";
TRL 1.16's ``SDPOTrainer``).

The online-RL loop is GRPO's (sample -> score with the reward functions -> split -> advantages -> buffer). SDPO's
advantage stage also builds each completion's teacher prompt (``Reprompts``): the prompt with another completion of
its group whose reward reached ``success_reward_threshold`` and/or the row's feedback (``privileged_context``); a
completion with neither is not distilled. Each training step then runs the student on ``[prompt, completion]``, the
teacher (``SelfTeacherKnobs``: an EMA of the policy by default) on ``[teacher prompt, completion]`` without
gradients, and trains on ``sdpo_loss``: ``(1 - distillation_weight)`` GRPO's policy term plus
``distillation_weight`` the self-distillation term.
"""

from __future__ import annotations

from typing import Any

import torch

from lightalign.datamodules.prompt import _tokenize_prompts, left_pad
from lightalign.knobs import takes_knobs
from lightalign.modules.agent.episodes import ToolKnobs
from lightalign.modules.grpo import GRPOModule
from lightalign.modules.losses.entropy import token_entropies
from lightalign.modules.losses.grpo import normalises_by_step_tokens
from lightalign.modules.losses.sdpo import SDPOKnobs, sdpo_loss
from lightalign.modules.losses.self_distill import SelfDistillLossKnobs
from lightalign.modules.reference.bema import BEMAKnobs
from lightalign.modules.reference.self_teacher import (SelfTeacherKnobs, build_self_teacher, check_self_teacher,
                                                       self_teacher_callbacks, self_teacher_model)
from lightalign.modules.reference.sync import ReferenceSyncKnobs
from lightalign.modules.reference.teacher_context import (CONTEXT_COLUMN, RepromptKnobs, Reprompts,
                                                          check_prompt_rows)
from lightalign.modules.rollout.buffer import in_rollout_order, scatter_rows
from lightalign.modules.rollout.offpolicy.component import AsyncRolloutKnobs
from lightalign.modules.rollout.scoring import metric_key
from lightalign.modules.training.logprobs import completion_logits

__all__ = ["SDPOModule"]

REPROMPT_STATS = ("reprompt_sample_fraction", "success_group_fraction", "success_sample_fraction",
                  "feedback_used_fraction")


@takes_knobs(SelfDistillLossKnobs, SelfTeacherKnobs, RepromptKnobs, SDPOKnobs,
             without=(ToolKnobs, AsyncRolloutKnobs, ReferenceSyncKnobs, BEMAKnobs),
             defaults={"distillation_alpha": 1.0, "distillation_mode": "sampled_token", "distillation_topk": None,
                       "teacher_model_kind": "ema", "disable_dropout": True})
class SDPOModule(GRPOModule):
    """SDPO on the prompt batches of ``PromptDataModule`` with reward functions (TRL's signature).

    TRL 1.16's ``SDPOTrainer`` (docs/self_distillation.md): GRPO's knobs (its ``loss_type`` dapo, ``epsilon``,
    ``importance_sampling_level``, ``scale_rewards``, the rollout schedule ...) for the policy term; the
    self-distillation loss (``SelfDistillLossKnobs``, SDPO's defaults: reverse KL on the sampled token), the teacher
    (``SelfTeacherKnobs``, an EMA of the policy at rate 0.05 by default), the teacher's prompt (``RepromptKnobs``)
    and the mix (``SDPOKnobs.distillation_weight``, 1 by default: self-distillation only).

    Not taken (``without=``): tools and environments (``ToolKnobs``: multi-turn rollouts are not distilled here),
    sampling ahead (``AsyncRolloutKnobs``), ``sync_ref_model`` and ``update_ref_model`` (``ReferenceSyncKnobs``,
    ``BEMAKnobs``: the teacher holds the reference's place and is the policy's own copy; ``teacher_model_kind`` 'ema'
    makes it follow the policy). Refused at construction, their groups staying because GRPO's shared code reads
    them: a KL term (``beta > 0``: TRL's SDPO stores it but applies none), a separately loaded reference (the
    teacher is the policy), the shared-prefix and padding-free layouts, and vLLM. Logged
    beside GRPO's statistics: ``train/distillation_loss`` and, per rollout, ``train/reprompt_sample_fraction`` (the
    completions distilled), ``train/success_group_fraction``, ``train/success_sample_fraction``,
    ``train/feedback_used_fraction``.
    """

    method_name = "SDPO"
    takes_images = False  # its teacher prompts are rebuilt from text: no image prompts
    method_stats = (*GRPOModule.method_stats, "distillation_loss", *REPROMPT_STATS)

    def check_knob_combinations(self) -> None:
        super().check_knob_combinations()
        knobs = self.knobs
        check_self_teacher(knobs.self_teacher, knobs.model.peft_config)
        refused = {
            "beta": (knobs.kl.beta > 0, "TRL 1.16's SDPO applies no KL term (its beta is stored, unused) and the "
                                        "teacher holds the reference model's place: set beta 0"),
            "ref_model_name_or_path": (bool(knobs.reference.ref_model_name_or_path or
                                            knobs.reference.ref_model_init_kwargs),
                                       "the teacher is the policy itself (teacher_model_kind), no other model"),
            "prompt_sharing / padding_free": (knobs.layout.prompt_sharing or knobs.layout.padding_free,
                                              "the teacher reads padded [teacher prompt, completion] rows: use the "
                                              "padded layout"),
            "use_vllm": (knobs.vllm.use_vllm, "sample with the transformers samplers (use_vllm false)"),
        }
        for name, (on, why) in refused.items():
            if on:
                raise ValueError(f"SDPOModule does not take {name} here: {why}.")

    def compose(self) -> None:
        super().compose()
        self.distill_config = self.knobs.self_distill_loss
        self.teacher_kind = self.knobs.self_teacher.teacher_model_kind
        self.reprompts = Reprompts(self.knobs.reprompt)
        self.rollout_text: tuple[list[Any], list[str], list[Any] | None] | None = None

    # ------------------------------------------------------------------------------------- setup
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":
            datamodule = self.trainer.datamodule
            for label, data in (("training", datamodule.train_dataset), ("validation", datamodule.val_dataset)):
                if data is not None:
                    check_prompt_rows(data, label, False, self.method_name)

    def configure_model(self) -> None:
        super().configure_model()  # beta is 0: no reference model; the teacher takes its place
        if self.ref_model is None and self.teacher_kind != "live":
            with torch.inference_mode(False):
                self.ref_model = build_self_teacher(self.teacher_kind, self.model, self.model_name_or_path,
                                                    self.hparams.trust_remote_code)

    def configure_callbacks(self) -> list:
        return [*super().configure_callbacks(), *self_teacher_callbacks(self.knobs.self_teacher)]

    def fit_start_notes(self) -> list[str]:
        return [*super().fit_start_notes(), f"teacher: the {self.teacher_kind} policy shown a successful completion"]

    # ------------------------------------------------------------------------------------- rollout
    def sample_rollout(self, batch: dict[str, Any]) -> dict[str, Any]:
        rollout = super().sample_rollout(batch)
        self.rollout_text = (rollout["prompts"], rollout["texts"], rollout["columns"].get(CONTEXT_COLUMN))
        return rollout

    def rollout_advantages(self, chunks: list[dict[str, torch.Tensor]]) -> None:
        """GRPO's advantages, then each completion's teacher prompt (``Reprompts``) tokenized as the prompt data
        tokenizes its rows, keeping its last ``max_reprompt_len`` tokens, and whether it is distilled."""
        super().rollout_advantages(chunks)
        (rewards,) = in_rollout_order(chunks, "rewards")
        prompts, texts, feedback = self.rollout_text
        teacher_prompts, active, stats = self.reprompts(prompts, texts, rewards.tolist(), feedback,
                                                        self.hparams.num_generations)
        datamodule = self.trainer.datamodule
        ids = _tokenize_prompts({"prompt": teacher_prompts}, self.tokenizer, self.hparams.max_reprompt_len,
                                datamodule.chat_template_kwargs)["prompt_input_ids"]
        teacher_ids, teacher_mask = left_pad(ids, self.tokenizer.pad_token_id, self.device)
        scatter_rows(chunks, teacher_prompt_ids=teacher_ids, teacher_prompt_mask=teacher_mask,
                     self_distillation_mask=torch.tensor(active, dtype=torch.float32, device=self.device))
        for name, value in stats.items():
            self.train_stats[metric_key(name)].update(torch.tensor(value, device=self.device))

    # ------------------------------------------------------------------------------------- training
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        weight = hp.distillation_weight
        if weight == 0.0:  # GRPO's policy gradient only (as TRL: no teacher forward)
            return super().training_step(batch, batch_idx)
        mb, slot = self.next_micro_batch(batch)
        with self.training_forward_context():
            student_logits = completion_logits(self.model, mb) / hp.temperature
        teacher_rows = {"prompt_ids": mb["teacher_prompt_ids"], "prompt_mask": mb["teacher_prompt_mask"],
                        "completion_ids": mb["completion_ids"], "completion_mask": mb["completion_mask"]}
        with torch.no_grad(), self_teacher_model(self.teacher_kind, self.ref_model, self.model) as teacher:
            teacher_logits = completion_logits(teacher, teacher_rows) / hp.temperature
        num_items, scale = None, 1.0
        if weight < 1.0 and normalises_by_step_tokens(hp.loss_type):
            num_items, scale = self.step_tokens(slot), float(self.trainer.accumulate_grad_batches)
        loss, stats = sdpo_loss(student_logits, teacher_logits, mb["completion_ids"], mb["completion_mask"],
                                mb["self_distillation_mask"], mb["advantages"], mb.get("old_logps"),
                                distillation_weight=weight, distill_config=self.distill_config,
                                policy_config=self.loss_config, max_completion_length=hp.max_completion_length,
                                num_items_in_batch=num_items, loss_scale=scale)
        s = self.train_stats
        s[metric_key("loss")].update(stats["loss"])
        for name, key in (("distillation_loss", "distillation_loss"), ("policy_loss", "policy_loss"),
                          ("clip_ratio", "clip_ratio/region_mean"), ("clip_ratio/low", "clip_ratio/low_mean"),
                          ("clip_ratio/high", "clip_ratio/high_mean")):
            if key in stats:
                s[metric_key(name)].update(stats[key])
        mask = mb["completion_mask"].bool()
        if hp.log_entropy and mask.any():
            s[metric_key("entropy")].update(token_entropies(student_logits.detach())[mask].mean())
        return self.add_router_aux_loss(loss)
