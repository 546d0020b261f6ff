"""Knowledge distillation: ``DistillModule``, a student trained towards a frozen teacher's next-token distributions.

Per batch of prompts (``PromptDataModule``): the completions come from the student (probability ``lmbda``, drawn
from torch's RNG so a resumed run draws the same), else from the teacher (``seq_kd``), else from the data's
``completion`` column. Student (with gradients) and teacher (``no_grad``, eval mode) then run on the same padded
``[prompt, completion]`` rows, and the loss compares them on the completion tokens: GKD's generalised JSD over the
whole vocabulary (``losses/distill.py``: ``generalized_jsd_loss``, chunked over tokens) or, with
``loss_type: on_policy``, the on-policy reverse-KL policy gradient, which reads only the teacher's log-prob of each
sampled token (``on_policy_distillation_loss``). The pieces are the shared ones: ``SamplingConfig`` and the samplers
(``generation/``), ``choose_sampler`` (``rollout/sampler_choice.py``), the reference component's loading, freezing
and placement of a separate frozen model (``reference/``), the RNG state of ``PolicyModule``'s checkpoints.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

import torch
from torchmetrics.aggregation import MeanMetric

from lightalign.datamodules.formats import DataFormatError, render_prompt_completion
from lightalign.modules.generation.config import SamplingConfig, with_sampling_knob_docs
from lightalign.modules.generation.sampling import sample_completions
from lightalign.modules.losses.distill import (DEFAULT_CHUNK_SIZE, generalized_jsd_loss,
                                               on_policy_distillation_advantages, on_policy_distillation_loss)
from lightalign.modules.reference.component import Reference
from lightalign.modules.reference.model import freeze
from lightalign.modules.training.logprobs import forward_accepts, selective_log_softmax
from lightalign.modules.training.policy import PolicyModule

DISTILL_LOSS_TYPES = ("gkd", "on_policy")


def model_vocab_size(model_or_path: Any, init_kwargs: dict[str, Any] | None = None,
                     trust_remote_code: bool = False) -> int | None:
    """The vocabulary size a model's logits have, from its config (a folder/hub name: ``config.json`` only, no
    weights read). None when it cannot be told (no config)."""
    if isinstance(model_or_path, torch.nn.Module):
        if hasattr(model_or_path, "get_output_embeddings") and model_or_path.get_output_embeddings() is not None:
            weight = model_or_path.get_output_embeddings().weight
            # under DeepSpeed ZeRO-3 a parameter is an empty placeholder of its partition; ds_shape is its full shape
            return int(getattr(weight, "ds_shape", weight.shape)[0])
        config = getattr(model_or_path, "config", None)
    else:
        from transformers import AutoConfig

        from lightalign.hub import _check_local_folder, _hub_kwargs

        _check_local_folder(model_or_path, "Model")
        revision = {k: v for k, v in (init_kwargs or {}).items() if k == "revision"}
        config = AutoConfig.from_pretrained(model_or_path, trust_remote_code=trust_remote_code,
                                            **_hub_kwargs(model_or_path), **revision)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    size = getattr(config, "vocab_size", None)
    return None if size is None else int(size)


def tokenize_completions(tokenizer: Any, prompts: list[Any], completions: list[Any], max_length: int,
                         ) -> list[list[int]]:
    """The data's completions as token ids, as SFT tokenises a prompt-completion row: a string completion without
    special tokens plus EOS; a conversational one as the chat template renders it after the prompt (with its
    generation prompt). Kept to the first ``max_length`` tokens."""
    rows = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        if isinstance(prompt, list) != isinstance(completion, list):
            raise DataFormatError(f"'prompt' and 'completion' must both be strings or both be message lists (batch "
                                  f"row {i}: prompt {type(prompt).__name__}, completion {type(completion).__name__}).")
        if isinstance(prompt, list):
            _, text = render_prompt_completion(tokenizer, prompt, completion)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
            if tokenizer.eos_token_id is not None:
                ids = ids + [tokenizer.eos_token_id]
        rows.append(list(ids)[:max_length])
    return rows


def right_pad(rows: list[list[int]], pad_token_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids.to(device), mask.to(device)


def completion_logits(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits ``[B, T, V]`` predicting each completion token of padded ``[left-padded prompt, completion]``
    rows (positions counted from each row's first real token, as the samplers used), a view of the model's output:
    no copy, untempered."""
    from lightalign.modules.adaptations.layouts import padded_position_ids

    t = rows["completion_ids"].shape[1]
    input_ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1)
    attention_mask = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=t + 1)
    if forward_accepts(model, "position_ids"):
        inputs["position_ids"] = padded_position_ids(attention_mask)
    return model(**inputs).logits[:, :-1]


@with_sampling_knob_docs
class DistillModule(PolicyModule):
    """Distil a frozen teacher into the policy (the student) on the prompts of ``PromptDataModule``.

    TRL 1.16's ``GKDTrainer`` and on-policy distillation (docs/distill.md).

    Each training batch is ``data.batch_size`` prompts with one completion each; the loss of a batch is the mean
    over its completion tokens. Logged per optimizer step: ``train/loss``, ``train/divergence`` (the per-token
    divergence of the loss type), ``train/student_sampled`` and ``train/teacher_sampled`` (the share of batches whose
    completions the student / the teacher sampled; the rest came from the data), ``train/completions/mean_length``;
    per validation: ``val/divergence`` (the student-teacher divergence of the loss type on the student's own samples
    of the held prompts) and ``val/completions/mean_length``.

    Args:
        teacher_model_name_or_path: the teacher: a hub name or a local folder with ``config.json`` and weights.
            Its vocabulary must be the student's (checked from both configs before any weights load).
        teacher_model: an already built teacher model (Python API only), instead of ``teacher_model_name_or_path``.
        teacher_model_init_kwargs: ``from_pretrained`` arguments of the teacher (``dtype``, an 8/4-bit
            ``quantization_config`` ...), as for a separately loaded reference model. The teacher is frozen, always
            in eval mode, held outside the module (never optimised nor checkpointed) and placed like the reference.
        loss_type: ``gkd``: the generalised Jensen-Shannon divergence over the vocabulary (``beta``);
            ``on_policy``: the on-policy reverse-KL signal (per sampled token, teacher minus student log-prob as a
            detached advantage of a policy-gradient loss); it trains on the student's own samples only (``lmbda``
            1, no ``seq_kd``).
        lmbda: the probability that a batch's completions are sampled by the student (TRL's name); otherwise the
            teacher samples them (``seq_kd``) or the data's ``completion`` column is used. Drawn once per batch from
            torch's RNG (a resumed run draws the same). Default (null): 0.5 (TRL GKD's) for ``gkd``, 1 for
            ``on_policy``, which refuses any other value.
        beta: ``gkd``: the divergence between forward KL(teacher || student) (0) and reverse KL(student || teacher)
            (1); 0.5 is the Jensen-Shannon divergence. Unused by ``on_policy``.
        temperature: sampling temperature of the student's and the teacher's completions, and the temperature both
            distributions are divided by in the loss (as TRL's ``DistillationTrainer``; TRL's ``GKDTrainer`` samples
            at it but compares the distributions at 1).
        seq_kd: when the student does not sample a batch, the teacher samples it (sequence-level KD) instead of the
            data's completions being used.
        max_completion_length: sampled completion tokens at most (TRL GKD's ``max_new_tokens``); the data's
            completions are cut to it too.
        <shared sampling knobs: generation/config.py SAMPLING_KNOB_DOCS>
        generation_kwargs: more ``generate`` arguments (``GenerationConfig`` fields such as ``suppress_tokens``);
            the ones set by the knobs here are refused naming the knob.
        generation_backend: the sampler, as for the online-RL methods (``generate``, ``continuous``, ``static``,
            ``compact``; unset: the device's measured default, decided at fit start for the student and for a
            ``seq_kd`` teacher separately).
        loss_chunk_size: tokens per chunk of the vocabulary-wide divergence (memory only, not the result).
        disable_dropout: set every dropout probability of the student to 0 (TRL GKD's default; the teacher is
            always in eval mode).
        **kwargs: ``PolicyModule`` arguments (model, LoRA, optimizer, schedule).
    """

    # TRL names of knobs this module spells otherwise
    knob_equivalents = {"max_new_tokens": "max_completion_length", "teacher_model_revision":
                        "teacher_model_init_kwargs.revision"}
    _unregistered_attributes = PolicyModule._unregistered_attributes | {"teacher"}
    teacher: torch.nn.Module | None = None

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        teacher_model_name_or_path: str | None = None,
        teacher_model: torch.nn.Module | None = None,
        teacher_model_init_kwargs: dict[str, Any] | None = None,
        loss_type: Literal["gkd", "on_policy"] = "gkd",
        lmbda: float | None = None,
        beta: float = 0.5,
        temperature: float = 0.9,
        seq_kd: bool = False,
        max_completion_length: int = 128,
        top_p: float = 1.0,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        generation_kwargs: dict[str, Any] | None = None,
        generation_backend: Literal["generate", "continuous", "static", "compact"] | None = None,
        loss_chunk_size: int = DEFAULT_CHUNK_SIZE,
        disable_dropout: bool = True,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        unknown = sorted(set(kwargs) - set(inspect.signature(PolicyModule.__init__).parameters))
        if unknown:
            knob = unknown[0]
            instead = self.knob_equivalents.get(knob)
            raise TypeError(f"{name} has no knob {knob!r}" + (f"; its {instead} is the same idea" if instead else "")
                            + f" (`lightalign fit --model.help {name}` lists its knobs).")
        if loss_type not in DISTILL_LOSS_TYPES:
            raise ValueError(f"loss_type={loss_type!r} is unknown; use one of {list(DISTILL_LOSS_TYPES)}.")
        if lmbda is None:
            lmbda = 1.0 if loss_type == "on_policy" else 0.5
        if not 0.0 <= lmbda <= 1.0:
            raise ValueError(f"lmbda is a probability (the share of batches the student samples), got {lmbda}.")
        if loss_type == "on_policy" and (lmbda != 1.0 or seq_kd):
            raise ValueError(f"loss_type='on_policy' trains on the student's own samples only: it needs lmbda 1 (got "
                             f"{lmbda}) and seq_kd false (got {seq_kd}). Use loss_type 'gkd' to distil on teacher or "
                             "dataset completions.")
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must lie in [0, 1] (0 = forward KL, 1 = reverse KL, 0.5 = JSD), got {beta}.")
        if loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size must be >= 1 token, got {loss_chunk_size}.")
        if teacher_model is None and not teacher_model_name_or_path:
            raise ValueError(f"{name} needs a teacher: teacher_model_name_or_path (a hub name or a local folder) or, "
                             "in Python, teacher_model (a built model).")
        if teacher_model is not None and teacher_model_name_or_path:
            raise ValueError("Pass either teacher_model_name_or_path or teacher_model (a built model), not both.")
        if kwargs.get("neftune_noise_alpha") is not None:
            raise ValueError(f"neftune_noise_alpha is not supported by {name}: the student's train-mode forward would "
                             "carry noise its samples did not; drop it.")
        # the sampling knobs' one definition and validation (generation/config.py); one completion per prompt, so
        # there is no prompt prefill to share
        sampling = SamplingConfig.from_knobs(
            max_completion_length=max_completion_length, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, repetition_penalty=repetition_penalty, generation_kwargs=generation_kwargs,
            cache_implementation=None, share_prefill=False, generation_backend=generation_backend)
        super().__init__(model_name_or_path, disable_dropout=disable_dropout, **kwargs)
        self.save_hyperparameters(ignore=["model", "teacher_model", "optimizer", "lr_scheduler", "eval_metrics"])
        self.hparams.lmbda = lmbda
        self.sampling = sampling
        self.teacher_component = Reference(teacher_model_name_or_path, teacher_model_init_kwargs)
        if teacher_model is not None:
            self.teacher = freeze(teacher_model)
        self.check_vocabularies()  # from the configs: before any weights load
        self.tokenizer: Any = None
        self.sampler_names: dict[str, tuple[str, str]] = {}  # "student"/"teacher" -> (sampler, fit-start note)
        self.train_stats = torch.nn.ModuleDict({k: MeanMetric() for k in (
            "loss", "divergence", "student_sampled", "teacher_sampled", "completions_mean_length")})
        self.eval_stats = torch.nn.ModuleDict({k: MeanMetric() for k in ("divergence", "completions_mean_length")})
        self.last_source: str | None = None  # who wrote the last training batch's completions (tests, logs)

    # ------------------------------------------------------------------------------------- teacher
    def check_vocabularies(self) -> None:
        """Refuse a teacher whose vocabulary differs from the student's, from the configs (no weights read)."""
        hp = self.hparams
        student = self.model if self.model is not None else self.model_name_or_path
        teacher = self.teacher if self.teacher is not None else hp.teacher_model_name_or_path
        student_size = model_vocab_size(student, hp.model_init_kwargs, hp.trust_remote_code)
        teacher_size = model_vocab_size(teacher, hp.teacher_model_init_kwargs, hp.trust_remote_code)
        if student_size is not None and teacher_size is not None and student_size != teacher_size:
            raise ValueError(
                f"The teacher's vocabulary ({teacher_size} tokens, {_describe(teacher)}) differs from the student's "
                f"({student_size} tokens, {_describe(student)}): distillation compares their distributions token by "
                "token, so both must use the same tokenizer and vocabulary. Pick a teacher of the student's family "
                "(or a student of the teacher's).")

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
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None)
        self.tokenizer = getattr(datamodule, "tokenizer", None)
        if stage != "fit":
            return
        if not hasattr(datamodule, "configure_rollout"):
            raise TypeError(f"{type(self).__name__} trains on PromptDataModule batches; got {type(datamodule).__name__}.")
        hp = self.hparams
        columns = getattr(getattr(datamodule, "train_dataset", None), "column_names", None)
        if hp.lmbda < 1.0 and not hp.seq_kd and columns is not None and "completion" not in columns:
            raise DataFormatError(
                f"lmbda is {hp.lmbda} and seq_kd is false, so {1 - hp.lmbda:.0%} of the batches train on the data's "
                f"completions, but the training data has no 'completion' column (it has {sorted(columns)}). Give "
                "prompt-completion data (a 'completion' column), set seq_kd: true (the teacher writes them) or "
                "lmbda: 1 (the student samples every batch).")

    def batch_layout(self) -> tuple[str, int | None]:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        prompt = getattr(datamodule, "max_prompt_length", None)
        return "grpo_padded", None if prompt is None else prompt + self.hparams.max_completion_length

    def on_fit_start(self) -> None:
        self.sampler_names = {}  # decided again in fit_start_notes (the models may have changed)
        self.teacher_component.move(self.teacher, self.device, self.model)
        super().on_fit_start()

    def fit_start_notes(self) -> list[str]:
        """The teacher's layout check (as a separate reference's) and the samplers, decided before any batch."""
        from lightalign.modules.adaptations import describe_decision
        from lightalign.modules.adaptations.support import check_layout

        layout, longest = self.batch_layout()
        teacher = describe_decision(check_layout(self.teacher_eval(), layout, max_tokens=longest))
        notes = [f"teacher {_describe(self.hparams.teacher_model_name_or_path or self.teacher)} ({teacher})"]
        notes.append(f"student {self.sampler_for('student')[1]}")
        if self.hparams.seq_kd:
            notes.append(f"teacher {self.sampler_for('teacher')[1]}")
        return notes

    def sampler_for(self, who: str) -> tuple[str, str]:
        """The sampler of the student's or the teacher's completions, decided once per fit (``choose_sampler``)."""
        from lightalign.modules.rollout.sampler_choice import choose_sampler

        if who not in self.sampler_names:
            model = self.model if who == "student" else self.teacher_eval()
            self.sampler_names[who] = choose_sampler(model, self.sampling, 1)
        return self.sampler_names[who]

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

    @torch.no_grad()
    def sample(self, who: str, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        model = self.model if who == "student" else self.teacher_eval()
        rollout = sample_completions(model, self.tokenizer, batch, 1, backend=self.sampler_for(who)[0],
                                     **self.sampling.sampling_kwargs())
        return {k: rollout[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}

    def data_completions(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        completions = batch["columns"].get("completion")
        if completions is None:
            raise DataFormatError("This batch's completions come from the data (lmbda < 1, seq_kd false), but it has "
                                  "no 'completion' column.")
        ids = tokenize_completions(self.tokenizer, batch["prompts"], completions, self.hparams.max_completion_length)
        completion_ids, completion_mask = right_pad(ids, self.tokenizer.pad_token_id, self.device)
        return {"prompt_ids": batch["prompt_input_ids"].to(self.device),
                "prompt_mask": batch["prompt_attention_mask"].to(self.device),
                "completion_ids": completion_ids, "completion_mask": completion_mask}

    def completions(self, batch: dict[str, Any], source: str) -> dict[str, torch.Tensor]:
        """The padded rows of a batch: its prompts and the completions ``source`` wrote."""
        if source == "data":
            return self.data_completions(batch)
        return self.sample(source, batch)

    # ------------------------------------------------------------------------------------- loss
    def distill_loss(self, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss of the rows, its per-token divergence, detached): the student's forward with gradients (when
        enabled), the teacher's without, on the same rows; only the completion tokens count."""
        hp = self.hparams
        mask = rows["completion_mask"].bool()
        with self.training_forward_context():
            student_logits = completion_logits(self.model, rows)
        with torch.no_grad():
            teacher_logits = completion_logits(self.teacher_eval(), rows)
        if hp.loss_type == "gkd":
            loss = generalized_jsd_loss(student_logits, teacher_logits, mask, beta=hp.beta,
                                        temperature=hp.temperature, chunk_size=hp.loss_chunk_size)
            return loss, loss.detach()
        ids = rows["completion_ids"]
        student_logps = selective_log_softmax(student_logits / hp.temperature, ids)
        with torch.no_grad():
            teacher_logps = selective_log_softmax(teacher_logits / hp.temperature, ids)
        advantages = on_policy_distillation_advantages(student_logps.detach(), teacher_logps, mask)
        loss = on_policy_distillation_loss(student_logps, advantages, mask)
        reverse_kl = -(advantages * mask).sum() / mask.sum().clamp(min=1)  # per-token estimate of KL(student||teacher)
        return loss, reverse_kl

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        source = self.draw_source()
        rows = self.completions(batch, source)
        self.last_source = source
        self.last_batch_tokens = int(rows["prompt_mask"].sum() + rows["completion_mask"].sum())  # throughput
        self.last_batch_samples = int(rows["completion_ids"].shape[0])
        loss, divergence = self.distill_loss(rows)
        stats = self.train_stats
        stats["loss"].update(loss.detach())
        stats["divergence"].update(divergence)
        stats["student_sampled"].update(float(source == "student"))
        stats["teacher_sampled"].update(float(source == "teacher"))
        stats["completions_mean_length"].update(rows["completion_mask"].sum(-1).float().mean())
        return self.add_router_aux_loss(loss)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        self._log_stats(self.train_stats, "train")

    def _log_stats(self, stats: torch.nn.ModuleDict, stage: str) -> None:
        for key, metric in stats.items():
            if metric.update_called:
                name = key.replace("completions_", "completions/")
                self.log(f"{stage}/{name}", metric.compute(), prog_bar=key in ("loss", "divergence"))
            metric.reset()

    # ------------------------------------------------------------------------------------- validation
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """The student samples the held prompts (its own seeded stream: validating changes no training draw) and
        the divergence of the loss type between student and teacher is measured on those samples."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.global_step * 100_003 + batch_idx)
            rows = self.sample("student", batch)
        _, divergence = self.distill_loss(rows)
        self.eval_stats["divergence"].update(divergence)
        self.eval_stats["completions_mean_length"].update(rows["completion_mask"].sum(-1).float().mean())

    def on_validation_epoch_end(self) -> None:
        self._log_stats(self.eval_stats, "val")
        self.log_eval_metrics("val")


def _describe(model_or_path: Any) -> str:
    if isinstance(model_or_path, torch.nn.Module):
        path = getattr(getattr(model_or_path, "config", None), "_name_or_path", "")
        return f"a built {type(model_or_path).__name__}" + (f" from '{path}'" if path else "")
    return f"'{model_or_path}'"
