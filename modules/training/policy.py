"""``PolicyModule``: the base every method builds on. It takes the knob groups every method shares and composes the
seams of a policy: the model (``ModelBuilding``), optimisation (``Optimization``), eval metrics (``EvalMetrics``) and
checkpoint state (``CheckpointState``); here: construction from the knob groups, the run's side effects, the
fit-start checks, the non-finite guard and the export."""

from __future__ import annotations

import difflib
import inspect
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightalign.callbacks.nonfinite import NonfiniteKnobs
from lightalign.knobs import KnobSet, method_knobs, takes_knobs
from lightalign.modules.adaptations import AdaptationReport
from lightalign.modules.losses.router_aux import RouterAuxKnobs
from lightalign.modules.reference.bema import refuse_bema_reference
from lightalign.modules.reference.sync import LORA, refuse_reference_sync
from lightalign.modules.training.acceleration import CPUMemoryKnobs
from lightalign.modules.training.checkpoint_state import CheckpointState
from lightalign.modules.training.dropout import DropoutKnobs
from lightalign.modules.training.eval_metrics import EvalMetrics, EvalMetricsKnobs
from lightalign.modules.training.export import export_hf
from lightalign.modules.training.model_building import ComputeKnobs, ModelBuilding, ModelKnobs
from lightalign.modules.training.optimization import Optimization, OptimizationKnobs
from lightalign.modules.training.optimizers import CLIPS_ITSELF
from lightalign.modules.training.side_effects import ScopedSideEffects
from lightalign.modules.training.vision_model import VisionModelKnobs, check_vision_model

# TRL's former names of knobs, refused naming the current one
RENAMED_KNOBS = {"vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max"}



def subclass_init_args(module: Any, frame: Any) -> dict[str, Any]:
    """The named arguments of the ``__init__`` frames of ``module`` from ``frame`` outwards: a subclass that declares
    arguments of its own in an ``__init__`` (rather than as a knob group) gets them saved as hyperparameters too.
    Its knobs are left to their groups, which say which ones are saved."""
    knobs = method_knobs(type(module))
    found: dict[str, Any] = {}
    while frame is not None and frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is module:
        info = inspect.getargvalues(frame)
        for name in info.args[1:]:
            if name not in knobs:
                found[name] = info.locals[name]
        frame = frame.f_back
    return found


# The public classes a method is built on, not methods a user trains with.
METHOD_BASES = frozenset({"PolicyModule", "OnlineRLModule", "CriticFreeModule"})


def methods_with_knob(knob: str) -> list[str]:
    """The public methods (``lightalign.modules.__all__``, not the bases a method is built on: ``PolicyModule``,
    ``OnlineRLModule``, ``CriticFreeModule``) that take ``knob``, by name. A method another method extends (GRPO,
    which SDPO extends) is a method still."""
    import lightalign.modules as methods

    public = [c for c in (getattr(methods, name) for name in methods.__all__) if isinstance(c, type)]
    return sorted(c.__name__ for c in public if c.__name__ not in METHOD_BASES and knob in method_knobs(c))


def taken_by(names: list[str]) -> str:
    """``A takes it``, ``A and B take it``, ``A, B and C take it`` (the methods a refusal names)."""
    if len(names) == 1:
        return f"{names[0]} takes it"
    return ", ".join(names[:-1]) + " and " + names[-1] + " take it"


@takes_knobs(ModelKnobs, ComputeKnobs, DropoutKnobs, RouterAuxKnobs, OptimizationKnobs, EvalMetricsKnobs,
             NonfiniteKnobs, CPUMemoryKnobs, VisionModelKnobs)
class PolicyModule(ModelBuilding, Optimization, EvalMetrics, CheckpointState, L.LightningModule):
    """Loads the policy and owns what every post-training method shares (its knobs: ``knob_groups``)."""

    uses_reference_model = False  # methods that keep a reference model (DPO, KTO, GRPO, RLOO, PPO) set this
    # whether the method is measured exact on rows with images (every forward reads them); the others refuse such
    # data at setup (refuse_unmeasured_images)
    takes_images = False
    # the method's proper name ("Online DPO"): the model card and the fit-time notes say it (None: the class name)
    method_name: str | None = None
    # switch knob -> the knobs that act only when it is on: the model card leaves them out when it is off
    switched_knobs: dict[str, tuple[str, ...]] = {
        "sync_ref_model": ("ref_model_mixup_alpha", "ref_model_sync_steps"),
        "update_ref_model": ("update_freq", "ema_power", "bias_power", "lag", "update_after", "multiplier",
                             "min_ema_multiplier", "device", "ref_model_update_freq", "ref_model_update_after")}
    # attributes kept out of the module tree (never optimised, checkpointed or wrapped by a strategy)
    _unregistered_attributes: frozenset[str] = frozenset({"ref_model", "side_effects", "knobs"})
    ref_model: torch.nn.Module | None = None  # the reference model (``Reference.build``), when the method has one

    knob_equivalents: dict[str, str] = {}  # TRL's (or a sibling method's) name -> this method's knob for the idea

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._unregistered_attributes:
            self.__dict__[name] = value
            return
        super().__setattr__(name, value)

    @classmethod
    def refuse_unknown_knobs(cls, unknown: dict[str, Any]) -> None:
        """A ``TypeError`` naming the first knob in ``unknown`` (knobs the method does not take), with TRL's current
        name for a former one, the method's knob for the same idea (``knob_equivalents``), the methods that take it,
        or the closest knob name."""
        if not unknown:
            return
        knob, name = sorted(unknown)[0], cls.__name__
        if knob in RENAMED_KNOBS:
            raise TypeError(f"{knob} is TRL's former name of {RENAMED_KNOBS[knob]}; use that.")
        instead = cls.knob_equivalents.get(knob)
        elsewhere = [] if instead else cls.methods_with_knob(knob)
        close = [] if instead or elsewhere else difflib.get_close_matches(knob, method_knobs(cls), n=1)
        raise TypeError(f"{name} has no knob {knob!r}" + (f"; its {instead} is the same idea" if instead else "")
                        + (f"; {taken_by(elsewhere)}" if elsewhere else "")
                        + (f"; did you mean {close[0]!r}?" if close else "")
                        + f" (`lightalign fit --model.help {name}` lists its knobs).")

    @classmethod
    def methods_with_knob(cls, knob: str) -> list[str]:
        """The other public methods that take ``knob`` (named in the refusal)."""
        return [name for name in methods_with_knob(knob) if name != cls.__name__]

    def construct_from_knobs(self, given: dict[str, Any]) -> None:
        """The constructor ``takes_knobs`` generates calls this with the knobs given: each group is built (and checks
        its knobs), the flat values are saved as hyperparameters, then ``compose`` builds the components."""
        frame = inspect.currentframe()
        outer = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        super().__init__()
        self.knobs = KnobSet({group.group: group.from_values(given) for group in type(self).knob_groups})
        saved = {f.name: getattr(group, f.name) for group in self.knobs for f in group.knob_fields()
                 if f.metadata["saved"]}
        self.save_hyperparameters({**subclass_init_args(self, outer), **saved})
        self.check_knob_combinations()
        self.compose()

    def check_knob_combinations(self) -> None:
        """Refuse combinations of knobs from several groups (each group checked its own knobs); a method extends it,
        calling ``super().check_knob_combinations()`` first. Runs at construction, before ``compose``."""
        model = self.knobs.model
        check_vision_model(self.knobs.vision_model, model.model, model.model_name_or_path, model.trust_remote_code)
        if "reference_sync" in self.knobs and self.knobs.reference_sync.sync_ref_model:  # methods with a reference
            refuse_reference_sync(self.reference_sync_blocker())
        if "bema" in self.knobs and self.knobs.bema.update_ref_model:  # the methods with a reference
            sync = "reference_sync" in self.knobs and self.knobs.reference_sync.sync_ref_model
            refuse_bema_reference(sync, self.reference_sync_blocker())

    def reference_sync_blocker(self) -> str | None:
        """Why this run has no reference model of its own in memory for ``sync_ref_model`` to mix into (None: it
        has one); a method with a reference puts its own reasons first."""
        if not self.uses_reference_model:
            return f"{type(self).__name__} has no reference model"
        if self.knobs.model.peft_config is not None:
            return LORA
        return None

    def compose(self) -> None:
        """Build the module's components from ``self.knobs`` (a subclass extends it, calling ``super().compose()``
        first)."""
        model = self.knobs.model
        self.model_name_or_path = model.model_name_or_path
        self.model = model.model
        self.build_eval_metrics()
        self.nonfinite_guard = None  # built by configure_callbacks
        self.neftune = None
        self.cpu_memory_retained = False  # glibc took retain_cpu_memory's setting at setup
        self.side_effects = ScopedSideEffects(model.model)
        self.lean_mlps = 0  # MLPs switched by recompute_mlp_activation
        self.adaptations = AdaptationReport()
        self.router_aux = None  # the MoE load-balancing loss collector, attached at fit start when in force
        self.dropout_report = None  # what disable_dropout zeroed (disable_dropout_in_model), said at fit start
        self.is_vision_language = False  # set when the model is prepared: a VLM exports its processor
        self.frozen_vision_parameters: list[str] = []  # what freeze_vision_tower / _projector froze
        if self.model is not None:
            self._prepare_model()

    # ----------------------------------------------------------------------------------------- scoped side effects
    def setup(self, stage: str) -> None:
        """Before every trainer entry (fit, validate, test, predict): the run's side effects outside the module's own
        model (``ScopedSideEffects``), undone by ``teardown`` or, when the run raises, by
        ``UndoSideEffectsOnError``."""
        self.refuse_unmeasured_images()
        self.side_effects.apply(self)

    def refuse_unmeasured_images(self) -> None:
        """Data with images (a vision-language model's ``images``/``image`` column, ``has_images`` of the datamodule)
        reaching a method not measured with them is refused before any compute, naming the methods that take them;
        for a method that takes them, a batch layout other than padded rows is refused with what its measurement on
        the model found (``refuse_image_layout``)."""
        datamodule = getattr(getattr(self, "_trainer", None), "datamodule", None)
        if not getattr(datamodule, "has_images", False):
            return
        if self.takes_images:
            from lightalign.modules.adaptations.support import PADDED_LAYOUTS

            layout, _ = self.batch_layout()
            if layout not in PADDED_LAYOUTS:  # measured on the model: its difference, or what is not built
                from lightalign.modules.adaptations.vision_probe import refuse_image_layout

                target = next(m for m in (getattr(self, "model", None), self.knobs.model.model,
                                          self.model_name_or_path) if m is not None)
                refuse_image_layout(target, layout, getattr(datamodule, "processor", None),
                                    f"{type(self).__name__} does not build {layout} rows with images")
            return
        import lightalign

        takers = sorted(name for name in getattr(lightalign, "__all__", ()) if name.endswith("Module")
                        and getattr(getattr(lightalign, name), "takes_images", False))
        raise ValueError(f"{type(self).__name__} is not measured on rows with images (the data's 'images'/'image' "
                         f"column for a vision-language model): its forwards would not read them. Methods that "
                         f"train with images: {', '.join(takers)}; or drop the image column.")

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
        from lightalign.modules.training.cpu_bf16 import precision_note
        from lightalign.modules.losses.router_aux import attach_router_aux_loss
        from lightalign.modules.training.device_tuning import tuning_note

        knobs = self.knobs
        layout, longest = self.batch_layout()
        neftune = self.neftune_noise_alpha
        if self.router_aux is not None:
            self.router_aux.remove()
        self.router_aux, aux_note = attach_router_aux_loss(self.model, knobs.router_aux.router_aux_loss_coef, layout)
        notes = [f"NEFTune alpha {neftune}"] if neftune else []
        if self.dropout_report is not None:
            notes.append(self.dropout_report.describe() + self.check_train_determinism())
        notes += [n for n in (aux_note, activation_offload_note(knobs.compute.activation_offloading, self.device)) if n]
        notes += self.fit_start_notes()
        notes.append(tuning_note(self.device))  # whether the device-tuned constants apply on this machine, and how
        if self._trainer is not None:  # the precision is the trainer's (a bare check at construction has none)
            notes.append(precision_note(self.trainer.precision, self.device))
        sync = knobs.reference_sync if "reference_sync" in knobs else None
        if sync is not None and sync.sync_ref_model:
            notes.append(f"reference synced every {sync.ref_model_sync_steps} steps (alpha {sync.ref_model_mixup_alpha})")
        bema = knobs.bema if "bema" in knobs else None
        if bema is not None and bema.update_ref_model:
            notes.append(f"reference = BEMA of the policy, renewed every {bema.ref_model_update_freq} steps "
                         f"(average every {bema.update_freq})")
        check_run(self.model, getattr(self, "ref_model", None), layout, longest, self.adaptations, self.device,
                  self.logger if self._trainer is not None else None, notes=notes,
                  precision=self.trainer.precision if self._trainer is not None else None)

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
        """The context of a training forward of the policy (``activation_offloading``; under ``bf16-mixed`` on the
        CPU, ``recast_saved_weights``: the weights' bf16 casts are not kept for the backward pass)."""
        from lightalign.modules.training.activation_offload import activation_offload_context
        from lightalign.modules.training.recast_weights import recast_saved_weights, recasts_weights

        if self._trainer is not None and recasts_weights(getattr(self.trainer, "precision", None), self.device,
                                                         self.model):
            return recast_saved_weights()  # activation_offloading changes nothing on the CPU
        return activation_offload_context(self.knobs.compute.activation_offloading, self.device)

    def add_router_aux_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss + router_aux_loss_coef * aux_loss`` of the forwards since the last call (MoE; else ``loss``)."""
        aux = self.router_aux.take() if self.router_aux is not None else None
        return loss if aux is None else loss + self.router_aux.coef * aux.to(loss.dtype)

    @property
    def neftune_noise_alpha(self) -> float | None:
        """NEFTune's alpha, for a method that takes ``NEFTuneKnobs`` (the supervised ones); else None."""
        return self.knobs.neftune.neftune_noise_alpha if "neftune" in self.knobs else None

    def attach_neftune(self) -> None:
        alpha = self.neftune_noise_alpha
        if alpha:  # noise while fitting only; on_fit_end restores the embeddings
            from lightalign.modules.training.neftune import NEFTune

            self.neftune = NEFTune(self.model, alpha).attach()

    def on_fit_end(self) -> None:
        if self.neftune is not None:
            self.neftune.detach()
            self.neftune = None

    def forward(self, **inputs: torch.Tensor):
        return self.model(**inputs)

    # ----------------------------------------------------------------------------------------- non-finite guard
    def configure_callbacks(self) -> list[L.Callback]:
        """The non-finite guard (``NonFiniteGuard``) and the carried training metrics of an exact resume
        (``CarriedStepMetrics``), added by the module so the Python API has them too."""
        from lightalign.callbacks.nonfinite import NonFiniteGuard
        from lightalign.callbacks.side_effects import UndoSideEffectsOnError
        from lightalign.modules.training.carried_metrics import CarriedStepMetrics

        knobs = self.knobs
        self.nonfinite_guard = NonFiniteGuard(knobs.nonfinite.nonfinite, knobs.nonfinite.max_consecutive_nonfinite_steps)
        callbacks: list[L.Callback] = [self.nonfinite_guard, UndoSideEffectsOnError(), CarriedStepMetrics()]
        sync = knobs.reference_sync if "reference_sync" in knobs else None
        if sync is not None and sync.sync_ref_model:
            from lightalign.callbacks.reference_sync import ReferenceSync

            callbacks.append(ReferenceSync(sync.ref_model_mixup_alpha, sync.ref_model_sync_steps))
        bema = knobs.bema if "bema" in knobs else None
        if bema is not None and bema.update_ref_model:
            from lightalign.callbacks.bema_reference import BEMAReference

            callbacks.append(BEMAReference(bema))
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
        clipping go through Lightning as usual; under ``bf16-mixed`` (no loss scaler, so nothing to unscale) they
        take the base precision plugin's clipping, which does not refuse the fused AdamW (``fused_adamw_applies``)."""
        guard = getattr(self, "nonfinite_guard", None)
        cached = guard.take_grad_norms() if guard is not None else None
        strategy = type(self.trainer.strategy).__name__ if self._trainer is not None else ""
        precision = str(self.trainer.precision) if self._trainer is not None else ""
        plain = strategy in CLIPS_ITSELF and precision != "16-mixed"
        if (not gradient_clip_val or str(gradient_clip_algorithm or "norm") != "norm" or cached is None
                or cached[1] is None or not plain
                or any(p.grad is not g for p, g in zip((p for p in self.parameters() if p.grad is not None),
                                                        cached[0]))):
            if precision == "bf16-mixed" and gradient_clip_val:
                from lightning.pytorch.plugins.precision import Precision

                return Precision.clip_gradients(self.trainer.precision_plugin, optimizer, gradient_clip_val,
                                                gradient_clip_algorithm or "norm")
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        grads, norms = cached
        total = torch.linalg.vector_norm(norms, 2.0)
        coef = torch.clamp(float(gradient_clip_val) / (total + 1e-6), max=1.0)
        if bool(coef < 1.0):
            torch._foreach_mul_(grads, coef)


    def export_hf(self, output_dir: str | os.PathLike, tokenizer: Any = None, merge_lora: bool = False,
                  state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """Write the policy as a Hugging Face model folder, atomically (``export_hf``). A module not trained yet
        builds its model first (``configure_model``), so it exports what it would train."""
        self.configure_model()
        return export_hf(self.model, output_dir, tokenizer=tokenizer, merge_lora=merge_lora, state_dict=state_dict,
                         random_base=self.knobs.model.from_config)
