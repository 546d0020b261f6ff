"""The policy-loading base every method builds on: model loading, LoRA, the optimizer hooks, checkpoints, export."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Literal

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import Metric

from lightalign.hub import load_causal_lm, normalize_init_kwargs
from lightalign.modules.training.export import export_hf
from lightalign.modules.training.lora import (  # noqa: F401
    apply_peft, check_quantized_policy, drop_quantization_state, enable_activation_checkpointing, is_peft_model,
    prepare_quantized_base)
from lightalign.modules.adaptations import AdaptationReport, adapt_model
from lightalign.modules.training.optimizers import (  # noqa: F401  (re-exported: the schedule and groups were defined here)
    ScheduleType,
    decay_parameter_groups,
    fused_adamw_applies,
    schedule_factor,
)
from lightalign.modules.training.side_effects import ScopedSideEffects
from lightalign.modules.training.rng_state import gather_rng_states, set_rng_state


def check_state_dict_matches(saved: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> None:
    """A checkpoint of another model (other names or shapes) fails here, naming the first difference."""
    if not saved or not current:
        return
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing or unexpected:
        raise ValueError(
            f"The checkpoint holds another model: {len(missing)} parameter(s) of this model are missing from it "
            f"(e.g. {missing[:2]}) and it has {len(unexpected)} unknown one(s) (e.g. {unexpected[:2]}). Resume with the "
            "same model_name_or_path (and peft_config) that wrote it."
        )
    for key, value in saved.items():
        if hasattr(value, "shape") and tuple(value.shape) != tuple(current[key].shape):
            raise ValueError(
                f"The checkpoint holds another model: '{key}' has shape {tuple(value.shape)} there and "
                f"{tuple(current[key].shape)} here. Resume with the same model that wrote it."
            )


class PolicyModule(L.LightningModule):
    """Loads the policy and owns what every post-training method shares.

    Args:
        model_name_or_path: a hub name (``Qwen/Qwen2.5-0.5B``) or a local folder with ``config.json``.
        model: an already built ``PreTrainedModel`` (Python API only); used instead of ``model_name_or_path``.
        from_config: build the model with random weights from the folder's ``config.json`` (the tiny models).
        model_init_kwargs: passed to ``from_pretrained``: ``dtype`` (``bfloat16``/``float32``/``auto``),
            ``attn_implementation`` (``sdpa``, ``eager``, ``flash_attention_2``), ``revision``, ``quantization_config`` …
        trust_remote_code: allow code shipped with the model repository (off unless asked).
        gradient_checkpointing: recompute activations in backward (non-reentrant) to save memory.
        peft_config: LoRA settings (``{r: 16, lora_alpha: 32, target_modules: all-linear}``) or a peft config object;
            only adapter parameters are trained. With a ``quantization_config``: QLoRA (``prepare_quantized_base``).
        optimizer: a factory ``params -> Optimizer`` (YAML: ``class_path: torch.optim.SGD``); default AdamW
            built from ``learning_rate``, ``weight_decay``, ``adam_beta1/2``, ``adam_epsilon``.
        optim: a named preset instead (TRL/transformers names): ``adamw_8bit``, ``adam_8bit``,
            ``paged_adamw_8bit``, ``lion``, ``lion_8bit``, ``galore_adamw``, ``galore_adafactor``,
            ``galore_adamw_8bit`` (GPU), ``adamw_torch``; built with ``learning_rate`` and the settings above.
        optim_args: extra keyword arguments of the preset (GaLore: ``rank``, ``update_proj_gap``, ``scale``).
        optim_target_modules: GaLore only: regexes or substrings naming the linear layers to project.
        lr_scheduler: a factory ``optimizer -> LRScheduler``, stepped every optimizer step; default: linear
            warmup then ``lr_scheduler_type``.
        learning_rate: peak learning rate of the default optimizer.
        weight_decay: decoupled weight decay (not applied to biases and norm weights).
        adam_beta1: the default AdamW's first-moment decay.
        adam_beta2: the default AdamW's second-moment decay.
        adam_epsilon: the default AdamW's denominator epsilon.
        lr_scheduler_type: ``linear`` | ``cosine`` | ``constant`` | ``cosine_with_min_lr``.
        warmup_ratio: warmup as a fraction of all optimizer steps (used when ``warmup_steps`` is 0).
        warmup_steps: warmup length in optimizer steps (wins over ``warmup_ratio``).
        min_lr_rate: floor of ``cosine_with_min_lr`` as a fraction of the peak.
        eval_metrics: extra validation/test metrics, logged as ``val/<name>``: torchmetrics objects (YAML
            ``class_path: torchmetrics.classification.BinaryAccuracy``) or callables ``fn(preds, target) -> float``
            (averaged over batches, weighted by batch size). Each method says what ``preds``/``target`` are.
        neftune_noise_alpha: NEFTune noise on the input embeddings during training (e.g. 5); off when None.
        torch_compile: ``torch.compile`` the model in place (``True`` or ``torch.compile`` keyword arguments).
        use_liger_kernel: Liger's fused Triton kernels (needs ``liger-kernel`` and a CUDA GPU).
        recompute_mlp_activation: gated SiLU MLPs (Llama, Qwen, Mistral …) keep ``gate(x)`` and ``up(x)`` for the
            backward pass and recompute ``silu(gate(x))`` there instead of keeping it: a quarter less MLP activation
            memory, bitwise the same values and gradients (``recompute_mlp_activation``). ``False`` keeps the model's
            own MLP forward. A model passed as ``model`` gets its own forwards back at teardown (and its attention
            implementation: ``sdpa_varlen`` or a GPU's flash attention are the module's choice), and the switch again
            at the next setup.
        retain_cpu_memory: when training on CPU under glibc, keep freed memory in the process instead of giving it back
            to the OS after every free, so each step's activations and gradients do not page-fault in again
            (``retain_freed_cpu_memory``; same peak RSS, faster steps: measured, see docs/performance.md). Process-wide
            from setup to teardown (also undone when the run raises; what the undo restores:
            ``release_freed_cpu_memory``); ``False`` leaves the allocator as it is. Applied only on the device type its
            threshold was measured on (CPU, ``tuned``'s table), never to GPU runs.
        nonfinite: what a NaN/inf gradient does: ``skip`` the optimizer step (warning, ``train/nonfinite_steps``
            counter; the weights stay finite), ``stop`` with an error naming the step, batch and parameter, or
            ``off``. With ``16-mixed`` precision the gradient scaler handles overflows and the gradient check stays
            off. Unless ``off``, NaN/inf weights after a step (an update that overflowed) stop the run with an error;
            non-finite weights are never checkpointed or exported (``NonFiniteGuard``).
        max_consecutive_nonfinite_steps: with ``nonfinite: skip``, stop with an error after this many skipped
            steps in a row; null: never.
        disable_dropout: set every dropout probability of the policy to 0 (``disable_dropout_in_model``; TRL's default:
            on for DPO, off for GRPO and SFT): ``nn.Dropout`` modules, the rates modules and configs keep (read at
            forward time), layer drop and MoE router jitter. The export's ``config.json`` keeps the user's values.
        router_aux_loss_coef: Mixture-of-Experts policies: weight of the router load-balancing loss added to the
            training loss (``attach_router_aux_loss``); null takes the model config's value, 0 turns it off; an
            error on a dense model. Padded layouts only (off, and said so at fit start, in the others).
        activation_offloading: keep activations saved for backward in pinned CPU memory (CUDA; on CPU it has no
            effect, which the fit-start line says).
        sync_ref_model: methods with a reference model (DPO, GRPO): every ``ref_model_sync_steps`` optimizer steps
            the reference becomes ``ref_model_mixup_alpha * policy + (1 - alpha) * reference`` (TR-DPO); kept in
            checkpoints. Not with precomputed reference log-probs, LoRA, a quantized reference or FSDP/ZeRO-3.
        ref_model_mixup_alpha: the mix's alpha (default 0.6).
        ref_model_sync_steps: optimizer steps between mixes (default 512).
    """

    uses_reference_model = False  # methods that keep a reference model (DPO, KTO, GRPO, RLOO, PPO) set this
    # the method's proper name ("Online DPO"): the model card and the fit-time notes say it (None: the class name)
    method_name: str | None = None
    # switch knob -> the knobs that act only when it is on: the model card leaves them out when it is off
    switched_knobs: dict[str, tuple[str, ...]] = {"sync_ref_model": ("ref_model_mixup_alpha", "ref_model_sync_steps")}
    # attributes kept out of the module tree (never optimised, checkpointed or wrapped by a strategy)
    _unregistered_attributes: frozenset[str] = frozenset({"ref_model", "side_effects"})
    ref_model: torch.nn.Module | None = None  # the reference model (``Reference``), when the method has one

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._unregistered_attributes:
            self.__dict__[name] = value
            return
        super().__setattr__(name, value)

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        model: torch.nn.Module | None = None,
        from_config: bool = False,
        model_init_kwargs: dict[str, Any] | None = None,
        trust_remote_code: bool = False,
        gradient_checkpointing: bool = False,
        peft_config: dict[str, Any] | None = None,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        learning_rate: float = 2e-5,
        weight_decay: float = 0.0,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        adam_epsilon: float = 1e-8,
        lr_scheduler_type: ScheduleType = "linear",
        warmup_ratio: float = 0.0,
        warmup_steps: int = 0,
        min_lr_rate: float = 0.0,
        eval_metrics: dict[str, Metric | Callable] | None = None,
        nonfinite: Literal["skip", "stop", "off"] = "skip",
        max_consecutive_nonfinite_steps: int | None = 10,
        optim: str | None = None,
        optim_args: dict[str, Any] | None = None,
        optim_target_modules: list[str] | str | None = None,
        neftune_noise_alpha: float | None = None,
        torch_compile: bool | dict[str, Any] = False,
        use_liger_kernel: bool = False,
        recompute_mlp_activation: bool = True,
        retain_cpu_memory: bool = True,
        disable_dropout: bool = False,
        router_aux_loss_coef: float | None = None,
        activation_offloading: bool = False,
        sync_ref_model: bool = False,
        ref_model_mixup_alpha: float = 0.6,
        ref_model_sync_steps: int = 512,
    ) -> None:
        super().__init__()
        if model is None and model_name_or_path is None:
            raise ValueError("Pass model_name_or_path (a hub name or a local folder) or a built model.")
        if lr_scheduler_type not in ("linear", "cosine", "constant", "cosine_with_min_lr"):
            raise ValueError(
                f"lr_scheduler_type='{lr_scheduler_type}' is unknown; use linear, cosine, constant or cosine_with_min_lr."
            )
        if nonfinite not in ("skip", "stop", "off"):
            raise ValueError(f"nonfinite='{nonfinite}' is unknown; use skip, stop or off.")
        if max_consecutive_nonfinite_steps is not None and max_consecutive_nonfinite_steps < 1:
            raise ValueError(f"max_consecutive_nonfinite_steps must be >= 1 or null, got {max_consecutive_nonfinite_steps}.")
        if not 0.0 <= warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}.")
        if weight_decay < 0:  # AdamW would grow the weights by lr * |weight_decay| each step instead of shrinking them
            raise ValueError(f"weight_decay must be >= 0 (0 turns it off), got {weight_decay}.")
        if optim is not None:
            from lightalign.modules.training.optimizers import check_optim_name

            check_optim_name(optim)
            if optimizer is not None:
                raise ValueError("Pass either optim (a named preset) or optimizer (a factory), not both.")
        if neftune_noise_alpha is not None and neftune_noise_alpha <= 0:
            raise ValueError(f"neftune_noise_alpha must be > 0 (TRL suggests 5), got {neftune_noise_alpha}.")
        if learning_rate < 0:
            raise ValueError(f"learning_rate must be > 0 (the peak of the schedule), got {learning_rate}.")
        if learning_rate == 0 and optimizer is None:  # allowed: losses measured on frozen weights
            warnings.warn("learning_rate is 0: the optimizer will not change the weights.", stacklevel=2)
        if model is None:  # the model's folder, named by its knob (the datamodule's tokenizer would name it first)
            from lightalign.hub import _check_local_folder

            _check_local_folder(model_name_or_path, "model", knob="model_name_or_path")
        if model is None and from_config and model_name_or_path and _has_weights(model_name_or_path):
            warnings.warn(f"from_config: true builds random weights from {model_name_or_path}/config.json and does not "
                          "load the weights in that folder; set from_config: false to train from them.", stacklevel=2)
        check_quantized_policy(model_init_kwargs if model is None else None, peft_config, from_config)  # QLoRA
        if model is None and not from_config:
            from lightalign.hub import check_weights

            check_weights(model_name_or_path, normalize_init_kwargs(model_init_kwargs))  # before any data is tokenized
        if router_aux_loss_coef is not None and not router_aux_loss_coef >= 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0 (null: the model config's value), got {router_aux_loss_coef}.")
        self.save_hyperparameters(ignore=["model", "optimizer", "lr_scheduler", "eval_metrics"])
        from lightalign.modules.reference.sync import check_reference_sync

        check_reference_sync(self.hparams, self.uses_reference_model, type(self).__name__)
        self.model_name_or_path = model_name_or_path
        self.model = model
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        metrics = dict(eval_metrics or {})
        self.eval_metric_objects = torch.nn.ModuleDict({k: v for k, v in metrics.items() if isinstance(v, Metric)})
        self.eval_metric_fns = {k: v for k, v in metrics.items() if not isinstance(v, Metric)}
        for name, fn in self.eval_metric_fns.items():
            if not callable(fn):
                raise TypeError(f"eval_metrics['{name}'] must be a torchmetrics Metric or a callable, got {type(fn).__name__}.")
        self._eval_fn_totals: dict[str, list[float]] = {}
        self.nonfinite_guard = None  # built by configure_callbacks
        self.neftune = None
        self.cpu_memory_retained = False  # glibc took retain_cpu_memory's setting at setup
        self.side_effects = ScopedSideEffects(model)
        self.lean_mlps = 0  # MLPs switched by recompute_mlp_activation
        self.adaptations = AdaptationReport()
        self.router_aux = None  # the MoE load-balancing loss collector, attached at fit start when in force
        self.dropout_report = None  # what disable_dropout zeroed (DropoutReport), said at fit start
        if model is not None:
            self._prepare_model()

    # ----------------------------------------------------------------------------------------- model
    def configure_model(self) -> None:
        """Build the policy lazily, so strategies (FSDP, DeepSpeed) can shard it as it is created."""
        if self.model is not None:
            return
        hp = self.hparams
        self.check_layout_before_loading()
        with torch.inference_mode(False):  # validate() before fit() calls this under inference mode
            self.model = load_causal_lm(
                self.model_name_or_path,
                from_config=hp.from_config,
                init_kwargs=hp.model_init_kwargs,
                trust_remote_code=hp.trust_remote_code,
            )
            self._prepare_model()

    def check_layout_before_loading(self) -> None:
        """Fitting a batch layout other than plain padded rows: measure it on the model's class and config (built
        on the meta device: no weights) before the weights load, so a refusal costs seconds, not a model load. The
        same check runs again at fit start on the loaded model (``check_model_layout``; its verdict is then read
        from the cache)."""
        from lightalign.hub import meta_causal_lm
        from lightalign.modules.adaptations import check_layout
        from lightalign.modules.adaptations.attention import use_varlen_sdpa
        from lightalign.modules.adaptations.support import PADDED_LAYOUTS

        if self._trainer is None or getattr(self.trainer, "datamodule", None) is None:
            return
        layout, longest = self.batch_layout()
        if layout in PADDED_LAYOUTS:
            return
        hp = self.hparams
        meta = meta_causal_lm(self.model_name_or_path, hp.model_init_kwargs, hp.trust_remote_code)
        if meta is not None:
            use_varlen_sdpa(meta)  # as adapt_model does for the real model
            check_layout(meta, layout, max_tokens=longest)

    def _prepare_model(self) -> None:
        hp = self.hparams
        self.model.train()  # from_pretrained returns eval mode; Lightning keeps submodule modes as they are
        if hp.get("disable_dropout"):
            from lightalign.modules.training.dropout import disable_dropout_in_model

            self.dropout_report = disable_dropout_in_model(self.model)
        if hp.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
        # model adaptations (adapt_model): Liger or MLP recompute, sdpa -> sdpa_varlen; each is exact where it is
        # applied, and the layout of the run is checked against the model at fit start (check_model_layout)
        self.adaptations = adapt_model(self.model, recompute_mlp=bool(hp.get("recompute_mlp_activation", True)),
                                       liger=bool(hp.get("use_liger_kernel")))
        self.lean_mlps = self.adaptations.mlps_switched
        if hp.peft_config is not None and not is_peft_model(self.model):
            prepare_quantized_base(self.model)  # QLoRA
            self.model = apply_peft(self.model, hp.peft_config)
        if hp.get("torch_compile"):
            from lightalign.modules.training.acceleration import compile_model

            compile_model(self.model, hp.torch_compile)

    # ----------------------------------------------------------------------------------------- scoped side effects
    def setup(self, stage: str) -> None:
        """Before every trainer entry (fit, validate, test, predict): the run's side effects outside the module's own
        model (``ScopedSideEffects``), undone by ``teardown`` or, when the run raises, by
        ``UndoSideEffectsOnError``."""
        self.side_effects.apply(self)

    def teardown(self, stage: str) -> None:
        self.undo_side_effects()

    def undo_side_effects(self) -> None:
        self.side_effects.undo(self)

    def on_fit_start(self) -> None:
        self.check_model_layout()
        self.attach_neftune()

    def batch_layout(self) -> tuple[str, int | None]:
        """The run's batch layout (``adaptations.LAYOUTS``) and its longest sequence in tokens, if known."""
        return "padded", None

    def check_model_layout(self) -> None:
        """At fit start, before any batch: refuse a layout the policy (or a separately loaded reference) cannot
        compute exactly, and say in one line what was adapted (``adaptations.check_run``)."""
        from lightalign.modules.adaptations import check_run

        from lightalign.modules.training.activation_offload import activation_offload_note
        from lightalign.modules.losses.router_aux import attach_router_aux_loss

        hp = self.hparams
        layout, longest = self.batch_layout()
        neftune = hp.get("neftune_noise_alpha")
        if self.router_aux is not None:
            self.router_aux.remove()
        self.router_aux, aux_note = attach_router_aux_loss(self.model, hp.get("router_aux_loss_coef"), layout)
        notes = [f"NEFTune alpha {neftune}"] if neftune else []
        if self.dropout_report is not None:
            notes.append(self.dropout_report.describe() + self.check_train_determinism())
        notes += [n for n in (aux_note, activation_offload_note(hp.get("activation_offloading", False), self.device)) if n]
        notes += self.fit_start_notes()
        if hp.get("sync_ref_model"):
            notes.append(f"reference synced every {hp.ref_model_sync_steps} steps (alpha {hp.ref_model_mixup_alpha})")
        check_run(self.model, getattr(self, "ref_model", None), layout, longest, self.adaptations, self.device,
                  self.logger if self._trainer is not None else None, notes=notes)

    def check_train_determinism(self) -> str:
        """With ``disable_dropout``: two train-mode forwards of the model's probe must agree (measured, cached).
        Randomness the model keeps by design (``DropoutReport.kept``) is warned about with its size; any other is
        refused."""
        from lightalign.modules.adaptations import describe_decision
        from lightalign.modules.adaptations.probe import TRAIN_DETERMINISM
        from lightalign.modules.adaptations.support import measured, model_traits

        verdict = measured(self.model, TRAIN_DETERMINISM)
        if verdict.exact:
            return f"; train-mode forward deterministic ({describe_decision(verdict)})"
        if self.dropout_report.kept and verdict.error is None:  # a warning: an info line alone went unnoticed
            rank_zero_warn(self.dropout_report.kept_warning(model_traits(self.model).name, verdict.difference))
            return f"; train-mode forwards still differ by up to {verdict.difference:.1e} (measured; see the warning)"
        raise ValueError(
            f"disable_dropout is on, but {model_traits(self.model).name} is still random in train mode: two "
            f"train-mode forwards of its probe differ ({verdict.describe()}; zeroed: "
            f"{self.dropout_report.describe()}). Some randomness of this model is not switched off by lightalign; "
            "set disable_dropout: false to train with it knowingly, or report the model.")

    def fit_start_notes(self) -> list[str]:
        """Facts a method adds to the fit-start line (e.g. GRPO's generation backend and how it was chosen)."""
        return []

    def training_forward_context(self):
        """The context of a training forward of the policy (``activation_offloading``)."""
        from lightalign.modules.training.activation_offload import activation_offload_context

        return activation_offload_context(bool(self.hparams.get("activation_offloading")), self.device)

    def add_router_aux_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss + router_aux_loss_coef * aux_loss`` of the forwards since the last call (MoE; else ``loss``)."""
        aux = self.router_aux.take() if self.router_aux is not None else None
        return loss if aux is None else loss + self.router_aux.coef * aux.to(loss.dtype)

    def attach_neftune(self) -> None:
        if self.hparams.get("neftune_noise_alpha"):  # noise while fitting only; on_fit_end restores the embeddings
            from lightalign.modules.training.neftune import NEFTune

            self.neftune = NEFTune(self.model, self.hparams.neftune_noise_alpha).attach()

    def on_fit_end(self) -> None:
        if self.neftune is not None:
            self.neftune.detach()
            self.neftune = None

    def forward(self, **inputs: torch.Tensor):
        return self.model(**inputs)

    # ----------------------------------------------------------------------------------------- metrics
    def on_train_start(self) -> None:
        # A validate() before fit() runs under inference mode and leaves the metric states as inference
        # tensors, which training cannot update in place: start training from fresh states.
        for metric in self.modules():
            if isinstance(metric, Metric):
                metric.reset()
        # Exact resume: the random streams continue where the checkpoint left them (restored here, after the
        # sanity-check validation, which must not shift them).
        pending = getattr(self, "_pending_rng_states", None)
        if pending:
            set_rng_state(pending[min(self.global_rank, len(pending) - 1)])
            self._pending_rng_states = None
        self.continue_schedule()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["lightalign_rng"] = gather_rng_states()
        checkpoint["lightalign_meta"] = {"module": type(self).__name__}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        meta = checkpoint.get("lightalign_meta", {})
        written_by = meta.get("module")
        if written_by is not None and written_by != type(self).__name__:
            raise ValueError(
                f"This checkpoint was written by {written_by}, not {type(self).__name__}: a run resumes with the method "
                f"that wrote it. To start {type(self).__name__} from those weights, export them (the HFExport folder "
                "of that run) and pass the folder as model_name_or_path, without ckpt_path."
            )
        check_state_dict_matches(checkpoint.get("state_dict", {}), self.state_dict())
        drop_quantization_state(self, checkpoint.get("state_dict", {}))  # QLoRA
        self._pending_rng_states = checkpoint.get("lightalign_rng")

    # ----------------------------------------------------------------------------------------- non-finite guard
    def configure_callbacks(self) -> list[L.Callback]:
        """The non-finite guard (``NonFiniteGuard``) and the carried training metrics of an exact resume
        (``CarriedStepMetrics``), added by the module so the Python API has them too."""
        from lightalign.callbacks.nonfinite import NonFiniteGuard
        from lightalign.callbacks.side_effects import UndoSideEffectsOnError
        from lightalign.modules.training.carried_metrics import CarriedStepMetrics

        hp = self.hparams
        self.nonfinite_guard = NonFiniteGuard(hp.get("nonfinite", "skip"), hp.get("max_consecutive_nonfinite_steps", 10))
        callbacks: list[L.Callback] = [self.nonfinite_guard, UndoSideEffectsOnError(), CarriedStepMetrics()]
        if hp.get("sync_ref_model"):
            from lightalign.callbacks.reference_sync import ReferenceSync

            callbacks.append(ReferenceSync(hp.ref_model_mixup_alpha, hp.ref_model_sync_steps))
        return callbacks

    @property
    def nonfinite_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients so far."""
        guard = getattr(self, "nonfinite_guard", None)
        return guard.nonfinite_steps if guard is not None else 0

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Norm clipping from the per-tensor norms the non-finite guard just computed (one pass over the gradients
        instead of two), exactly ``torch.nn.utils.clip_grad_norm_``'s arithmetic; the multiply is skipped when the
        norm is under the limit (a factor of 1 changes nothing). Sharded strategies, fp16 loss scaling and value
        clipping go through Lightning as usual."""
        guard = getattr(self, "nonfinite_guard", None)
        cached = guard.take_grad_norms() if guard is not None else None
        strategy = type(self.trainer.strategy).__name__ if self._trainer is not None else ""
        plain = strategy in ("SingleDeviceStrategy", "DDPStrategy") and "16-mixed" not in str(self.trainer.precision)
        if (not gradient_clip_val or str(gradient_clip_algorithm or "norm") != "norm" or cached is None
                or cached[1] is None or not plain):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        grads, norms = cached
        if any(p.grad is not g for p, g in zip((p for p in self.parameters() if p.grad is not None), grads)):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        total = torch.linalg.vector_norm(norms, 2.0)
        coef = torch.clamp(float(gradient_clip_val) / (total + 1e-6), max=1.0)
        if bool(coef < 1.0):
            torch._foreach_mul_(grads, coef)

    def update_eval_metrics(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Feed the user's ``eval_metrics`` with one batch of predictions and targets."""
        for metric in self.eval_metric_objects.values():
            metric.update(preds, target)
        n = float(target.shape[0]) if target.ndim else 1.0
        for name, fn in self.eval_metric_fns.items():
            value = float(torch.as_tensor(fn(preds, target)).float().mean())
            total = self._eval_fn_totals.setdefault(name, [0.0, 0.0])
            total[0] += value * n
            total[1] += n

    def log_eval_metrics(self, stage: str) -> None:
        for name, metric in self.eval_metric_objects.items():
            self.log(f"{stage}/{name}", metric.compute())
            metric.reset()
        for name, (weighted, n) in self._eval_fn_totals.items():
            value = torch.tensor([weighted, n], dtype=torch.float64, device=self.device)
            if self._trainer is not None and self.trainer.world_size > 1:
                value = self.trainer.strategy.reduce(value, reduce_op="sum")
            self.log(f"{stage}/{name}", float(value[0] / value[1].clamp(min=1)))
        self._eval_fn_totals = {}

    # ----------------------------------------------------------------------------------------- optim
    def configure_optimizers(self):
        optimizer = self.create_optimizer()
        scheduler = self.create_lr_scheduler(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Lightning's step, then the gradients are freed at once. Lightning itself zeroes them only after the next
        step's forward, so a whole model's worth of gradients would sit through that forward (the peak of a step);
        the transformers Trainer frees them here too. DeepSpeed owns its gradient buffers and is left alone."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.nonfinite_guard is not None:
            self.nonfinite_guard.grad_norms = None  # its references to this step's gradients, if clipping did not take them
        if self._trainer is None or "deepspeed" not in type(self.trainer.strategy).__name__.lower():
            optimizer.zero_grad(set_to_none=True)

    def create_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the trainable parameters: ``optimizer`` factory, ``optim`` preset, or AdamW.
        Override to build your own; the schedule (``create_lr_scheduler``) still applies."""
        hp = self.hparams
        if isinstance(self.optimizer_factory, torch.optim.Optimizer):  # an instance, built over this model (Python)
            from lightalign.modules.training.optimizers import check_optimizer_instance

            return check_optimizer_instance(self.optimizer_factory, self.model)
        if self.optimizer_factory is not None:
            return self.optimizer_factory([p for p in self.model.parameters() if p.requires_grad])
        betas = (hp.adam_beta1, hp.adam_beta2)
        if hp.get("optim") is not None:
            from lightalign.modules.training.optimizers import build_named_optimizer

            return build_named_optimizer(hp.optim, self.model, lr=hp.learning_rate, weight_decay=hp.weight_decay,
                                         betas=betas, eps=hp.adam_epsilon, optim_args=hp.optim_args,
                                         optim_target_modules=hp.optim_target_modules)
        groups = decay_parameter_groups(self.model, hp.weight_decay)
        return torch.optim.AdamW(groups, lr=hp.learning_rate, betas=betas, eps=hp.adam_epsilon,
                                 fused=fused_adamw_applies(groups, self._trainer))

    def create_lr_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int | None = None) -> torch.optim.lr_scheduler.LRScheduler:
        """The schedule, stepped every optimizer step: ``lr_scheduler`` factory, or warmup + ``lr_scheduler_type``
        over ``total_steps`` (default: the Trainer's estimate)."""
        hp = self.hparams
        if isinstance(self.lr_scheduler_factory, torch.optim.lr_scheduler.LRScheduler):
            scheduler = self.lr_scheduler_factory  # an instance, over the optimizer instance passed with it
        elif self.lr_scheduler_factory is not None:
            scheduler = self.lr_scheduler_factory(optimizer)
        else:
            total = total_steps or (int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1)
            warmup = hp.warmup_steps or math.ceil(hp.warmup_ratio * total)
            def factor(step: int) -> float:
                return schedule_factor(step, total, warmup, hp.lr_scheduler_type, hp.min_lr_rate)

            # what continue_schedule names on resume; on the function, which LambdaLR does not checkpoint (the
            # scheduler's own attributes would come back from the checkpoint with the old run's values)
            factor.lightalign_span = (total, warmup)
            scheduler = LambdaLR(optimizer, factor)
        return scheduler

    def continue_schedule(self) -> None:
        """On resume, after the optimizer and schedule states are restored: the optimizer holds the learning rate the
        checkpoint's run set for its next step, computed over *that* run's ``max_steps``. A resume with another
        ``max_steps`` continues the schedule built for the new one instead, at the lr an uninterrupted run with
        that ``max_steps`` would use at this step, and says so."""
        if self._trainer is None or self.trainer.ckpt_path is None:
            return
        for config in self.trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            span = getattr(getattr(scheduler, "lr_lambdas", [None])[0], "lightalign_span", None)
            if span is None:
                continue
            step = scheduler.last_epoch
            groups = scheduler.optimizer.param_groups
            new = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
            old = [group["lr"] for group in groups]
            if all(math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0) for a, b in zip(old, new)):
                continue
            for group, lr in zip(groups, new):
                group["lr"] = lr
            scheduler._last_lr = list(new)
            rank_zero_info(f"Resumed at step {step} with max_steps {self.trainer.max_steps}: the learning-rate schedule "
                           f"is rebuilt over {span[0]} steps (warmup {span[1]}), so step {step + 1} runs at lr "
                           f"{new[0]:.3g} as an uninterrupted run of {span[0]} steps would (the interrupted run's shorter "
                           f"schedule would give it lr {old[0]:.3g}).")

    # ----------------------------------------------------------------------------------------- export
    def export_hf(self, output_dir: str | os.PathLike, tokenizer: Any = None, merge_lora: bool = False,
                  state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """Write the policy as a Hugging Face model folder, atomically (``export_hf``).
        A module not trained yet builds its model first (``configure_model``), so it exports what it would train."""
        self.configure_model()
        return export_hf(self.model, output_dir, tokenizer=tokenizer, merge_lora=merge_lora, state_dict=state_dict,
                         random_base=bool(self.hparams.get("from_config")))


def _has_weights(name_or_path: str) -> bool:
    """Whether a local model folder holds weight files (safetensors or PyTorch bins)."""
    folder = Path(name_or_path)
    return folder.is_dir() and any(any(folder.glob(p)) for p in ("*.safetensors", "pytorch_model*.bin"))
