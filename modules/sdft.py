"""Self-distillation fine-tuning: ``SDFTModule``, on-policy distillation from the policy itself shown a
demonstration (Shenfeld et al. 2026, "Self-Distillation Enables Continual Learning"; TRL 1.16's ``SDFTTrainer``).

Per training step: the batch's prompts (``generation_batch_size / num_generations`` of them) -> the student samples
``num_generations`` completions of each (of the teacher's prompt instead with ``generate_from_teacher``) -> the
student runs on ``[prompt, completion]`` with gradients, the teacher (``SelfTeacherKnobs``: the initial, the live or
an EMA policy) without, on ``[teacher prompt, completion]``, the teacher prompt being the row's prompt with its
``privileged_context`` (``DemonstrationPrompts``) -> the self-distillation loss of the two models' distributions on
the completion tokens (``self_distillation_loss``, ``distillation_mode``). The pieces are the shared ones:
``SamplingModule``'s sampling, the reference component's frozen copy and TR-DPO mix (the teacher), the RNG state of
``PolicyModule``'s checkpoints.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightalign.datamodules.prompt import _tokenize_prompts, left_pad
from lightalign.knobs import KnobGroup, knob, takes_knobs
from lightalign.modules.losses.entropy import token_entropies
from lightalign.modules.losses.self_distill import SelfDistillLossKnobs, self_distillation_loss
from lightalign.modules.reference.component import Reference
from lightalign.modules.reference.self_teacher import (SelfTeacherKnobs, build_self_teacher, check_self_teacher,
                                                       self_teacher_callbacks, self_teacher_model)
from lightalign.modules.reference.teacher_context import (CONTEXT_COLUMN, DemonstrationPrompts, TeacherPromptKnobs,
                                                          check_prompt_rows)
from lightalign.modules.rollout.buffer import RolloutKnobs
from lightalign.modules.sampling.module import SamplingModule
from lightalign.modules.training.logprobs import completion_logits
from lightalign.modules.training.stat_metrics import StatMetrics

__all__ = ["SDFTKnobs", "SDFTModule"]

SDFT_STATS = ("loss", "distillation_loss", "entropy", "completions/mean_length", "completions/clipped_ratio")


@dataclasses.dataclass(frozen=True)
class SDFTKnobs(KnobGroup):
    """SDFT's own choices: who the completions are sampled for, and which of their tokens are learned from."""

    group = "sdft"
    generate_from_teacher: bool = knob(
        False, "the student samples its completions of the teacher's prompt (prompt plus privileged context) "
               "instead of its own prompt; they are still learned from after the student's prompt.")
    num_loss_tokens_to_skip: int = knob(
        0, "the first completion tokens left out of the loss (the ones most marked by the teacher's prompt).")

    def check(self) -> None:
        if self.num_loss_tokens_to_skip < 0:
            raise ValueError(f"num_loss_tokens_to_skip must be >= 0, got {self.num_loss_tokens_to_skip}.")


@takes_knobs(RolloutKnobs, SelfDistillLossKnobs, SelfTeacherKnobs, TeacherPromptKnobs, SDFTKnobs,
             defaults={"disable_dropout": True})
class SDFTModule(SamplingModule):
    """SDFT on the prompt batches of ``PromptDataModule``, whose rows carry a ``privileged_context`` column.

    TRL 1.16's ``SDFTTrainer`` (docs/self_distillation.md): the loss (``SelfDistillLossKnobs``: top-k logit
    distillation of the student's 100 most likely tokens at ``distillation_alpha`` 0.5 by default), the teacher
    (``SelfTeacherKnobs``, the initial policy by default), its prompt (``TeacherPromptKnobs``), the rollout's size
    (``RolloutKnobs``: ``num_generations`` 8, ``generation_batch_size`` completions per step, default one prompt's
    group), on the shared sampling knobs. ``temperature`` samples and divides both models' logits (TRL's).

    Each rollout is trained on once, in the step that sampled it, so the importance weight of
    ``distillation_is_clip`` is 1 (TRL's default schedule computes no sampling log-probs either). Logged per
    optimizer step: ``train/loss``, ``train/distillation_loss`` (the mean per-token loss over the kept tokens),
    ``train/entropy`` (``log_entropy``), ``train/completions/mean_length`` and ``/clipped_ratio``; per validation:
    ``val/distillation_loss`` on the student's own samples of the held prompts (``num_generations_eval``).
    """

    method_name = "SDFT"
    progress_stats = ("loss",)
    summary_stats = {"distillation_loss": "min"}

    def check_knob_combinations(self) -> None:
        super().check_knob_combinations()
        check_self_teacher(self.knobs.self_teacher, self.knobs.model.peft_config)
        if self.knobs.rollout.num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {self.knobs.rollout.num_generations}.")
        if self.knobs.vllm.use_vllm:
            raise ValueError("SDFTModule samples with the transformers samplers only: set use_vllm false "
                             "(generation_backend picks among them).")

    def compose(self) -> None:
        super().compose()
        self.loss_config = self.knobs.self_distill_loss
        self.teacher_kind = self.knobs.self_teacher.teacher_model_kind
        self.teacher_prompts = DemonstrationPrompts(self.knobs.teacher_prompt)
        self.train_stats = StatMetrics(SDFT_STATS)
        self.eval_stats = StatMetrics(("distillation_loss", "completions/mean_length"))

    @property
    def prompts_per_step(self) -> int:
        hp = self.hparams
        return (hp.generation_batch_size or hp.num_generations) // hp.num_generations

    # ------------------------------------------------------------------------------------- setup
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        datamodule = self.trainer.datamodule
        datamodule.configure_rollout(self.prompts_per_step, 1)
        for label, data in (("training", datamodule.train_dataset), ("validation", datamodule.val_dataset)):
            if data is not None:
                check_prompt_rows(data, label, True, self.method_name)

    def configure_model(self) -> None:
        super().configure_model()
        if self.ref_model is None and self.teacher_kind != "live":
            with torch.inference_mode(False):
                self.ref_model = build_self_teacher(self.teacher_kind, self.model, self.model_name_or_path,
                                                    self.hparams.trust_remote_code)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        Reference().move(self.ref_model, self.device, self.model)

    def configure_callbacks(self) -> list:
        return [*super().configure_callbacks(), *self_teacher_callbacks(self.knobs.self_teacher)]

    def largest_group(self) -> int:
        hp = self.hparams
        return max(hp.num_generations, hp.num_generations_eval or hp.num_generations)

    def fit_start_notes(self) -> list[str]:
        self.sampling.backend(self.model, "policy", self.largest_group())
        return [f"teacher: the {self.teacher_kind} policy given each row's {CONTEXT_COLUMN}",
                f"policy {self.sampling.note('policy')}"]

    # ------------------------------------------------------------------------------------- rollout
    def prompt_rows(self, prompts: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``prompts`` tokenized as the prompt data tokenizes its rows, left-padded, on the module's device."""
        datamodule = self.trainer.datamodule
        ids = _tokenize_prompts({"prompt": prompts}, self.tokenizer, datamodule.max_prompt_length,
                                datamodule.chat_template_kwargs)["prompt_input_ids"]
        return left_pad(ids, self.tokenizer.pad_token_id, self.device)

    def rollout(self, batch: dict[str, Any], num_generations: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(the student's rows, the teacher's rows) of ``num_generations`` completions per prompt of ``batch``."""
        teacher_prompts = self.teacher_prompts(batch["prompts"], batch["columns"][CONTEXT_COLUMN])
        teacher_ids, teacher_mask = self.prompt_rows(teacher_prompts)
        source = batch
        if self.hparams.generate_from_teacher:
            source = {**batch, "prompts": teacher_prompts, "prompt_input_ids": teacher_ids,
                      "prompt_attention_mask": teacher_mask}
        sampled = self.sampling.sample(self.model, self.tokenizer, source, num_generations, who="policy",
                                       largest_group=self.largest_group())
        completion = {"completion_ids": sampled["completion_ids"], "completion_mask": sampled["completion_mask"]}
        student = {"prompt_ids": batch["prompt_input_ids"].to(self.device).repeat_interleave(num_generations, 0),
                   "prompt_mask": batch["prompt_attention_mask"].to(self.device).repeat_interleave(num_generations, 0),
                   "truncated": sampled["truncated"], **completion}
        teacher = {"prompt_ids": teacher_ids.repeat_interleave(num_generations, 0),
                   "prompt_mask": teacher_mask.repeat_interleave(num_generations, 0), **completion}
        return student, teacher

    def loss_mask(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The completion tokens the loss reads: not padding, not among the first ``num_loss_tokens_to_skip``, not
        of a truncated completion with ``mask_truncated_completions``."""
        hp = self.hparams
        mask = rows["completion_mask"].clone()
        mask[:, :hp.num_loss_tokens_to_skip] = 0
        if hp.mask_truncated_completions:
            mask = mask * (~rows["truncated"].to(mask.device)).long().unsqueeze(-1)
        return mask

    def distill(self, student_rows: dict[str, torch.Tensor], teacher_rows: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """(loss, stats, the student's tempered logits detached) of the rows: the student with gradients (when
        enabled), the teacher without."""
        temperature = self.hparams.temperature
        with self.training_forward_context():
            student_logits = completion_logits(self.model, student_rows) / temperature
        with torch.no_grad(), self_teacher_model(self.teacher_kind, self.ref_model, self.model) as teacher:
            teacher_logits = completion_logits(teacher, teacher_rows) / temperature
        loss, stats = self_distillation_loss(student_logits, teacher_logits, student_rows["completion_ids"],
                                             self.loss_mask(student_rows), self.loss_config)
        return loss, stats, student_logits.detach()

    # ------------------------------------------------------------------------------------- steps
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        student, teacher = self.rollout(batch, self.hparams.num_generations)
        self.last_batch_tokens = int(student["prompt_mask"].sum() + student["completion_mask"].sum())  # throughput
        self.last_batch_samples = int(student["completion_ids"].shape[0])
        loss, stats, logits = self.distill(student, teacher)
        s = self.train_stats
        s["loss"].update(loss.detach())
        s["distillation_loss"].update(stats["distillation_loss"])
        mask = student["completion_mask"].bool()
        if self.hparams.log_entropy and mask.any():
            s["entropy"].update(token_entropies(logits)[mask].mean())
        s["completions__mean_length"].update(student["completion_mask"].sum(-1).float().mean())
        s["completions__clipped_ratio"].update(student["truncated"].float().mean())
        return self.add_router_aux_loss(loss)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """The student samples the held prompts (validation's own seeded stream) and the loss is measured there."""
        hp = self.hparams
        with self.sampling.validation_stream(self, batch_idx):
            student, teacher = self.rollout(batch, hp.num_generations_eval or hp.num_generations)
        _, stats, _ = self.distill(student, teacher)
        self.eval_stats["distillation_loss"].update(stats["distillation_loss"])
        self.eval_stats["completions__mean_length"].update(student["completion_mask"].sum(-1).float().mean())
