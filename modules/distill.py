"""Knowledge distillation: ``DistillModule``, a student trained towards a frozen teacher's next-token distributions.

Per batch of prompts (``PromptDataModule``): the completions come from the student (probability ``lmbda``, drawn
from torch's RNG so a resumed run draws the same), else from the teacher (``seq_kd``), else from the data's
``completion`` column. Student (with gradients) and teacher (``no_grad``, eval mode) then run on the same padded
``[prompt, completion]`` rows, and the loss compares them on the completion tokens: GKD's generalised JSD over the
whole vocabulary (``generalized_jsd_loss``, chunked over tokens) or, with
``loss_type: on_policy``, the on-policy reverse-KL policy gradient, which reads only the teacher's log-prob of each
sampled token (``on_policy_distillation_loss``). The pieces are the shared ones: ``SamplingModule`` (the sampling
knobs, the ``Sampling`` component choosing each model's sampler or, with ``use_vllm``, handing it the vLLM engines'
samplers, the logged statistics: ``sampling/``), the reference
component's loading, freezing and placement of a separate frozen model (``Reference``) and its vocabulary check
(``check_same_vocabulary``), the RNG state of ``PolicyModule``'s checkpoints.

Prompts with images (a vision-language student and teacher of one processor, TRL's ``GKDTrainer`` given a processor):
the prompt batch carries each row's images (``ImagePromptCollator``), the student's and the teacher's samples are
drawn on the ``generate`` backend with them, and both forwards read them (``completion_logits`` adds the rows' image
inputs; an mRoPE model computes its own positions). The rows stay padded: the padding-free packing is not measured
exact with images (``check_image_prompts`` refuses ``padding_free: true``; unset, it resolves to padded rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightalign.datamodules.distill_rows import data_columns, right_pad, tokenize_completions
from lightalign.datamodules.formats import DataFormatError
from lightalign.datamodules.image_prompts import prompt_image_entries
from lightalign.knobs import KnobGroup, knob, takes_knobs
from lightalign.modules.losses.distill import (DISTILL_LOSS_TYPES, DistillLossKnobs, generalized_jsd_loss,
                                               on_policy_distillation_advantages, on_policy_distillation_loss)
from lightalign.modules.adaptations.layouts import packed_completion_batch
from lightalign.modules.training.rollout_forward import packed_logits
from lightalign.modules.rollout.offpolicy.component import MISMATCH_STATS, update_mismatch_stats
from lightalign.modules.reference.component import Reference
from lightalign.modules.reference.model import freeze
from lightalign.modules.reference.teacher import TeacherKnobs
from lightalign.modules.reference.vocabulary import check_same_vocabulary, describe_model
from lightalign.modules.sampling.module import SamplingModule
from lightalign.modules.training.logprobs import completion_logits, scatter_to_sequences, selective_log_softmax
from lightalign.modules.training.stat_metrics import StatMetrics

__all__ = ["DISTILL_LOSS_TYPES", "DistillLayoutKnobs", "DistillModule"]


@dataclasses.dataclass(frozen=True)
class DistillLayoutKnobs(KnobGroup):
    """The layout of the rows student and teacher run on. Not online RL's ``padding_free`` (``RolloutLayoutKnobs``):
    unset here means the device's measured default, decided at fit start on both models."""

    group = "distill_layout"
    padding_free: bool | None = knob(
        None, "the student and the teacher run on the rows with no padding: every ``[prompt, completion]`` one after "
              "the other in one row, positions restarting at each, one attention call per sequence (``sdpa_varlen``), "
              "logits only where a completion token is predicted. The same loss up to float32 rounding with fewer "
              "tokens through both models (faster the more of the padded tokens are padding: measured, see "
              "docs/distill.md 'Speed and memory against TRL'). Null (default): the device's measured default "
              "(``distill_padding_free`` in ``tuned``'s table: on on the CPU, off elsewhere), and padded rows for a "
              "student or teacher measured at fit start not to run it exactly (the fit-start line says which and "
              "why). True: asked, refused at fit start on a student or teacher that cannot run it exactly (measured on "
              "the model's class). False: padded rows. The name TRL's SFT and DPO use for the idea (TRL's GKD collator "
              "pads).")


@takes_knobs(TeacherKnobs, DistillLossKnobs, DistillLayoutKnobs,
             defaults={"max_completion_length": 128, "temperature": 0.9, "disable_dropout": True})
class DistillModule(SamplingModule):
    """Distil a frozen teacher into the policy (the student) on the prompts of ``PromptDataModule``.

    TRL 1.16's ``GKDTrainer`` and on-policy distillation (docs/distill.md). Its knobs: the teacher
    (``TeacherKnobs``), the loss and the completions' source (``DistillLossKnobs``), the rows' layout
    (``DistillLayoutKnobs``), on the shared sampling knobs. ``temperature`` (0.9 here) samples the student's and the
    teacher's completions and divides both distributions in the loss (as TRL's ``DistillationTrainer``; TRL's
    ``GKDTrainer`` samples at it but compares the distributions at 1); ``max_completion_length`` (128, TRL GKD's
    ``max_new_tokens``) cuts the data's completions too; ``disable_dropout`` (on, TRL GKD's default) applies to the
    student (the teacher is always in eval mode).

    Each training batch is ``data.batch_size`` prompts with one completion each; the loss of a batch is the mean
    over its completion tokens. Logged per optimizer step: ``train/loss``, ``train/divergence`` (the per-token
    divergence of the loss type), ``train/student_sampled`` and ``train/teacher_sampled`` (the share of batches whose
    completions the student / the teacher sampled; the rest came from the data), ``train/completions/mean_length``;
    per validation: ``val/divergence`` (the student-teacher divergence of the loss type on the student's own samples
    of the held prompts) and ``val/completions/mean_length``. With ``use_vllm`` also, on the batches the student's
    engine sampled: ``train/sampling/sampling_logp_difference/mean`` and ``/max`` and ``train/sampling/kl`` (how
    far the engine's log-probs of its tokens are from the student's, as online RL logs them).

    With ``use_vllm`` (``SamplingModule``'s knobs, docs/vllm.md) the student's completions come from a vLLM engine
    holding its weights (pushed at fit start and after every optimizer step) and, with ``seq_kd``, the teacher's
    from a second engine given the teacher's weights once (``vllm_mode: colocate`` only). The engine is not the
    student to the last bit, so its samples are slightly off-policy; as TRL 1.16 does (``DistillationTrainer``,
    ``IWOPDTrainer``), no importance-sampling ratio corrects that: ``gkd`` compares the two distributions at every
    position whoever sampled, and ``on_policy``'s advantage takes the engine's log-prob of each token as the
    sampler's (TRL's ``rollout_logprobs``; a token the engine gave none for takes the student's).
    """

    method_name = "Distillation (GKD / on-policy)"
    # TRL names of knobs this module spells otherwise
    knob_equivalents = {"max_new_tokens": "max_completion_length", "teacher_model_revision":
                        "teacher_model_init_kwargs.revision"}
    progress_stats = ("loss", "divergence")
    summary_stats = {"divergence": "min"}  # the run summary's lines beyond the shared ones (RunSummary)
    _unregistered_attributes = SamplingModule._unregistered_attributes | {"teacher"}
    takes_images = True  # prompts with images: both models sample and score with them (check_image_prompts)
    teacher: torch.nn.Module | None = None

    def check_knob_combinations(self) -> None:
        """``seq_kd`` with ``use_vllm`` needs a colocated engine and a full-precision teacher by name; refused before
        the sampling knobs are checked (``super()``, whose vLLM check also asks for a GPU): a combination that runs
        nowhere is named before one this machine cannot run."""
        vllm, loss, teacher = self.knobs.vllm, self.knobs.distill_loss, self.knobs.teacher
        if vllm.use_vllm and loss.seq_kd:
            if vllm.vllm_mode == "server":
                raise ValueError("seq_kd with use_vllm samples the teacher's completions on a vLLM engine of its own, "
                                 "which lightalign builds colocated only (the server holds the student): use "
                                 "vllm_mode: colocate, or seq_kd: false.")
            if teacher.teacher_model is not None or \
                    (teacher.teacher_model_init_kwargs or {}).get("quantization_config") is not None:
                raise ValueError("seq_kd with use_vllm loads the teacher into a vLLM engine from "
                                 "teacher_model_name_or_path in full precision: give the teacher by its folder or hub "
                                 "name, without a quantization_config, or set seq_kd: false.")
        super().check_knob_combinations()

    def compose(self) -> None:
        super().compose()
        teacher = self.knobs.teacher
        self.teacher_component = Reference(teacher.teacher_model_name_or_path, teacher.teacher_model_init_kwargs)
        if teacher.teacher_model is not None:
            self.teacher = freeze(teacher.teacher_model)
        self.check_vocabularies()  # from the configs: before any weights load
        self.train_stats = StatMetrics(("loss", "divergence", "student_sampled", "teacher_sampled",
                                        "completions/mean_length", *(MISMATCH_STATS if self.hparams.use_vllm else ())))
        self.eval_stats = StatMetrics(("divergence", "completions/mean_length"))
        self.last_source: str | None = None  # who wrote the last training batch's completions (tests, logs)
        self.packed_rows: bool | None = None  # padding_free as decided at fit start (resolve_padding_free)
        self.padding_free_note: str | None = None

    # ------------------------------------------------------------------------------------- teacher
    def check_vocabularies(self) -> None:
        """Refuse a teacher whose vocabulary differs from the student's, from the configs (no weights read)."""
        hp = self.hparams
        check_same_vocabulary(self.model if self.model is not None else self.model_name_or_path,
                              self.teacher if self.teacher is not None else hp.teacher_model_name_or_path,
                              hp.model_init_kwargs, hp.teacher_model_init_kwargs, hp.trust_remote_code)

    def configure_model(self) -> None:
        super().configure_model()
        if self.teacher is None:
            with torch.inference_mode(False):
                self.teacher = self.teacher_component.build(self.model, None, self.hparams.trust_remote_code)
        self.check_vocabularies()  # again on the built models: their logits' sizes

    def teacher_eval(self) -> torch.nn.Module:
        """The teacher, in eval mode whatever was called on the module (its dropout never samples)."""
        self.teacher.eval()
        return self.teacher

    # ------------------------------------------------------------------------------------- setup
    def setup(self, stage: str) -> None:
        super().setup(stage)  # the tokenizer; PromptDataModule batches
        if stage != "fit":
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        hp = self.hparams
        columns = getattr(getattr(datamodule, "train_dataset", None), "column_names", None)
        if hp.lmbda < 1.0 and not hp.seq_kd and columns is not None and "completion" not in columns:
            raise DataFormatError(
                f"lmbda is {hp.lmbda} and seq_kd is false, so {1 - hp.lmbda:.0%} of the batches train on the data's "
                f"completions, but the training data has no 'completion' column (it has {data_columns(columns)}). Give "
                "prompt-completion data (a 'completion' column), set seq_kd: true (the teacher writes them) or "
                "lmbda: 1 (the student samples every batch).")

    def data_completion_use(self) -> str:
        """The data's completions train the batches neither the student nor (``seq_kd``) the teacher samples."""
        hp = self.hparams
        if hp.lmbda >= 1.0:
            return "is dropped: the student samples every batch's completions (lmbda 1)"
        if hp.seq_kd:
            return (f"is dropped: the student (lmbda {hp.lmbda:g}) or the teacher (seq_kd) samples every batch's "
                    "completions")
        return (f"is the completion of the {1 - hp.lmbda:.0%} of batches the student does not sample (lmbda "
                f"{hp.lmbda:g}); the others drop it")

    def on_fit_start(self) -> None:
        self.teacher_component.move(self.teacher, self.device, self.model)
        super().on_fit_start()  # the samplers are decided again in fit_start_notes

    def check_model_layout(self) -> None:
        self.packed_rows, self.padding_free_note = self.resolve_padding_free()  # before the layout is checked
        super().check_model_layout()

    def resolve_padding_free(self) -> tuple[bool, str | None]:
        """(whether the rows are packed, the fit-start note saying so and why): ``padding_free`` as set, else
        ``default_padding_free`` on the student and the teacher."""
        asked = self.hparams.padding_free
        if asked is not None:
            return bool(asked), "padding_free (asked)" if asked else "padded rows (padding_free: false)"
        if self.sampling.images:  # padding_free: true is refused at setup with images (check_image_prompts)
            return False, "padded rows: the prompts have images (padding_free is not measured exact with them)"
        return default_padding_free(self.model, self.teacher_eval(), self.device, super().batch_layout()[1])

    def fit_start_notes(self) -> list[str]:
        """The teacher's layout check (as a separate reference's) and the samplers, decided before any batch."""
        from lightalign.modules.adaptations import describe_decision
        from lightalign.modules.adaptations.support import check_layout

        layout, longest = self.batch_layout()
        teacher = describe_decision(check_layout(self.teacher_eval(), layout, max_tokens=longest,
                                                 precision=self.trainer.precision if self._trainer else None))
        notes = [f"teacher {describe_model(self.hparams.teacher_model_name_or_path or self.teacher)} ({teacher})"]
        if self.padding_free_note:
            notes.append(self.padding_free_note)
        for who in ("student", "teacher") if self.hparams.seq_kd else ("student",):
            self.sampling.backend(self.sampler_model(who), who)
            notes.append(f"{who} {self.sampling.note(who)}")
        return notes

    def batch_layout(self) -> tuple[str, int | None]:
        """Padded ``[prompt, completion]`` rows, or with ``padding_free`` the same sequences packed into one row
        (the default's decision is known from fit start on: padded before it)."""
        layout, longest = super().batch_layout()
        return ("grpo_packed" if self.padding_free_on else layout), longest

    @property
    def padding_free_on(self) -> bool:
        """Whether the rows are packed: ``padding_free`` as set, else as decided at fit start."""
        asked = self.hparams.padding_free
        return bool(self.packed_rows) if asked is None else bool(asked)

    def sampler_model(self, who: str) -> torch.nn.Module:
        return self.model if who == "student" else self.teacher_eval()

    def vllm_models(self) -> list[tuple[str, torch.nn.Module, str | None, bool]]:
        """The student's engine (its weights pushed after every optimizer step) and, with ``seq_kd``, the frozen
        teacher's (its weights pushed once)."""
        teacher = [("teacher", self.teacher_eval(), self.hparams.teacher_model_name_or_path, False)]
        return [("student", self.model, self.model_name_or_path, True), *(teacher if self.hparams.seq_kd else [])]

    # ------------------------------------------------------------------------------------- completions
    def draw_source(self) -> str:
        """Who writes this batch's completions: the student with probability ``lmbda`` (torch's RNG), else the
        teacher (``seq_kd``) or the data."""
        hp = self.hparams
        if hp.lmbda >= 1.0:
            return "student"
        draw = float(torch.rand(()))
        if draw < hp.lmbda:
            return "student"
        return "teacher" if hp.seq_kd else "data"

    def sample(self, who: str, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """One completion per prompt from ``who``; the student's engine (``use_vllm``) also gives its log-probs of
        the sampled tokens (``sampling_logps``)."""
        engine = who == "student" and who in self.sampling.engines
        rollout = self.sampling.sample(self.sampler_model(who), self.tokenizer, batch, 1, who=who,
                                       **({"return_logprobs": True} if engine else {}))
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", *(("sampling_logps",) if engine
                                                                                    else ()))
        return {**{k: rollout[k] for k in keys}, **prompt_image_entries(rollout)}

    def data_completions(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        completions = batch["columns"].get("completion")
        if completions is None:
            raise DataFormatError("This batch's completions come from the data (lmbda < 1, seq_kd false), but it has "
                                  "no 'completion' column.")
        ids = tokenize_completions(self.tokenizer, batch["prompts"], completions, self.hparams.max_completion_length)
        completion_ids, completion_mask = right_pad(ids, self.tokenizer.pad_token_id, self.device)
        return {"prompt_ids": batch["prompt_input_ids"].to(self.device),
                "prompt_mask": batch["prompt_attention_mask"].to(self.device),
                "completion_ids": completion_ids, "completion_mask": completion_mask,
                **prompt_image_entries(batch)}  # the prompts' images, for both forwards

    def completions(self, batch: dict[str, Any], source: str) -> dict[str, torch.Tensor]:
        """The padded rows of a batch: its prompts and the completions ``source`` wrote."""
        if source == "data":
            return self.data_completions(batch)
        return self.sample(source, batch)

    # ------------------------------------------------------------------------------------- loss
    def distill_loss(self, rows: dict[str, torch.Tensor], stats: torch.nn.ModuleDict | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss of the rows, its per-token divergence, detached): the student's forward with gradients (when
        enabled), the teacher's without, on the same rows; only the completion tokens count. Rows an engine sampled
        (``sampling_logps``) log the engine-student mismatch in ``stats``; ``on_policy`` takes the engine's
        log-probs as the sampler's."""
        hp = self.hparams
        mask = rows["completion_mask"].bool()
        # padded: logits [B, T, V] under the completion mask; padding-free: [targets, V], every row a target
        packed = packed_completion_batch(rows) if self.padding_free_on else None
        with self.training_forward_context():
            student_logits = self.forward_logits(self.model, rows, packed)
        with torch.no_grad():
            teacher_logits = self.forward_logits(self.teacher_eval(), rows, packed)
        ids = rows["completion_ids"] if packed is None else packed["targets"]

        def per_token(logps: torch.Tensor) -> torch.Tensor:  # [B, T] (packed: 0 where a row has no token)
            return logps if packed is None else scatter_to_sequences(logps, packed, *mask.shape)[0]

        sampler_logps = None
        if "sampling_logps" in rows:
            with torch.no_grad():
                own = per_token(selective_log_softmax(student_logits.detach() / hp.temperature, ids))
            engine = rows["sampling_logps"].to(own.dtype)
            sampler_logps = torch.where(torch.isnan(engine), own, engine)  # a token the engine gave none for: own
            if stats is not None:
                update_mismatch_stats(stats, own, engine, mask)
        if hp.loss_type == "gkd":
            kept = mask if packed is None else torch.ones(student_logits.shape[:-1], dtype=torch.bool,
                                                          device=student_logits.device)
            loss = generalized_jsd_loss(student_logits, teacher_logits, kept, beta=hp.beta,
                                        temperature=hp.temperature, chunk_size=hp.loss_chunk_size)
            return loss, loss.detach()
        student_logps = per_token(selective_log_softmax(student_logits / hp.temperature, ids))
        with torch.no_grad():
            teacher_logps = per_token(selective_log_softmax(teacher_logits / hp.temperature, ids))
        advantages = on_policy_distillation_advantages(
            student_logps.detach() if sampler_logps is None else sampler_logps, teacher_logps, mask,
            iw_opd_gamma=hp.iw_opd_gamma)
        loss = on_policy_distillation_loss(student_logps, advantages, mask)
        reverse_kl = -(advantages * mask).sum() / mask.sum().clamp(min=1)  # per-token estimate of KL(student||teacher)
        return loss, reverse_kl

    @staticmethod
    def forward_logits(model: torch.nn.Module, rows: dict[str, torch.Tensor],
                       packed: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The logits predicting the completion tokens, untempered: ``[B, T, V]`` of the padded rows, or ``[targets,
        V]`` of their padding-free packing (``packed_completion_batch``)."""
        return completion_logits(model, rows) if packed is None else packed_logits(model, packed)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        source = self.draw_source()
        rows = self.completions(batch, source)
        self.last_source = source
        self.last_batch_tokens = int(rows["prompt_mask"].sum() + rows["completion_mask"].sum())  # throughput
        self.last_batch_samples = int(rows["completion_ids"].shape[0])
        stats = self.train_stats
        loss, divergence = self.distill_loss(rows, stats)
        stats["loss"].update(loss.detach())
        stats["divergence"].update(divergence)
        stats["student_sampled"].update(float(source == "student"))
        stats["teacher_sampled"].update(float(source == "teacher"))
        stats["completions__mean_length"].update(rows["completion_mask"].sum(-1).float().mean())
        return self.add_router_aux_loss(loss)

    # ------------------------------------------------------------------------------------- validation
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """The student samples the held prompts (its own seeded stream: validating changes no training draw) and
        the divergence of the loss type between student and teacher is measured on those samples."""
        with self.sampling.validation_stream(self, batch_idx):
            rows = self.sample("student", batch)
        _, divergence = self.distill_loss(rows)
        self.eval_stats["divergence"].update(divergence)
        self.eval_stats["completions__mean_length"].update(rows["completion_mask"].sum(-1).float().mean())



def default_padding_free(student: torch.nn.Module, teacher: torch.nn.Module, device: torch.device,
                         longest: int | None) -> tuple[bool, str | None]:
    """DistillModule's ``padding_free`` when it is unset: the device's measured default (``distill_padding_free``
    in ``tuned``'s table), and padded rows when the student or the teacher does not run the packed layout
    exactly (measured on a probe of its class, ``adaptations.check_layout``). Returns (packed, the fit-start note)."""
    from lightalign.modules.adaptations.support import LayoutRefused, check_layout
    from lightalign.modules.training.device_tuning import tuned

    if not tuned("distill_padding_free", device):
        return False, None
    for who, model in (("student", student), ("teacher", teacher)):
        try:
            check_layout(model, "grpo_packed", max_tokens=longest)
        except LayoutRefused as refused:
            return False, f"padded rows: the default padding_free is not exact on the {who}: {refused}"
    return True, "padding_free (the CPU default)"
