"""The optimizer and learning-rate schedule: their knobs (``OptimizationKnobs``) and ``PolicyModule``'s
optimisation seam (``Optimization``: build, step, resume the schedule)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from torch.optim.lr_scheduler import LambdaLR

from lightalign.knobs import KnobGroup, knob
from lightalign.modules.training.optimizers import (ScheduleType, decay_parameter_groups, fused_adamw_applies,
                                                    schedule_factor)

SCHEDULE_TYPES = ("linear", "cosine", "constant", "cosine_with_min_lr")


@dataclasses.dataclass(frozen=True)
class OptimizationKnobs(KnobGroup):
    """The optimizer (a factory, a named preset, or AdamW from the settings here) and its schedule."""

    group = "optimization"
    optimizer: OptimizerCallable | None = knob(
        None, "a factory ``params -> Optimizer`` (YAML: ``class_path: torch.optim.SGD``); default AdamW built from "
              "``learning_rate``, ``weight_decay``, ``adam_beta1/2``, ``adam_epsilon``.", saved=False)
    lr_scheduler: LRSchedulerCallable | None = knob(
        None, "a factory ``optimizer -> LRScheduler``, stepped every optimizer step; default: linear warmup then "
              "``lr_scheduler_type``.", saved=False)
    learning_rate: float = knob(2e-5, "peak learning rate of the default optimizer.")
    weight_decay: float = knob(0.0, "decoupled weight decay (not applied to biases and norm weights).")
    adam_beta1: float = knob(0.9, "the default AdamW's first-moment decay.")
    adam_beta2: float = knob(0.999, "the default AdamW's second-moment decay.")
    adam_epsilon: float = knob(1e-8, "the default AdamW's denominator epsilon.")
    lr_scheduler_type: ScheduleType = knob("linear", "``linear`` | ``cosine`` | ``constant`` | ``cosine_with_min_lr``.")
    warmup_ratio: float = knob(0.0, "warmup as a fraction of all optimizer steps (used when ``warmup_steps`` is 0).")
    warmup_steps: int = knob(0, "warmup length in optimizer steps (wins over ``warmup_ratio``).")
    min_lr_rate: float = knob(0.0, "floor of ``cosine_with_min_lr`` as a fraction of the peak.")
    optim: str | None = knob(
        None, "a named preset instead (TRL/transformers names): ``adamw_8bit``, ``adam_8bit``, ``paged_adamw_8bit``, "
              "``lion``, ``lion_8bit``, ``galore_adamw``, ``galore_adafactor``, ``galore_adamw_8bit`` (GPU), "
              "``adamw_torch``; built with ``learning_rate`` and the settings above.")
    optim_args: dict[str, Any] | None = knob(None, "extra keyword arguments of the preset (GaLore: ``rank``, "
                                                   "``update_proj_gap``, ``scale``).")
    optim_target_modules: list[str] | str | None = knob(None, "GaLore only: regexes or substrings naming the linear "
                                                              "layers to project.")

    def check(self) -> None:
        if self.lr_scheduler_type not in SCHEDULE_TYPES:
            raise ValueError(f"lr_scheduler_type='{self.lr_scheduler_type}' is unknown; use linear, cosine, constant "
                             "or cosine_with_min_lr.")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}.")
        if self.weight_decay < 0:  # AdamW would grow the weights by lr * |weight_decay| each step
            raise ValueError(f"weight_decay must be >= 0 (0 turns it off), got {self.weight_decay}.")
        if self.optim is not None:
            from lightalign.modules.training.optimizers import check_optim_preset

            check_optim_preset(self.optim, self.optim_target_modules)
            if self.optimizer is not None:
                raise ValueError("Pass either optim (a named preset) or optimizer (a factory), not both.")
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be > 0 (the peak of the schedule), got {self.learning_rate}.")
        if self.learning_rate == 0 and self.optimizer is None:  # allowed: losses measured on frozen weights
            warnings.warn("learning_rate is 0: the optimizer will not change the weights.", stacklevel=2)


class Optimization:
    """``PolicyModule``'s optimisation seam: the optimizer over the trainable parameters, its schedule, the step
    (gradients freed at once) and the schedule continued on resume."""

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
        knobs = self.knobs.optimization
        factory = knobs.optimizer
        if isinstance(factory, torch.optim.Optimizer):  # an instance, built over this model (Python API)
            from lightalign.modules.training.optimizers import check_optimizer_instance

            return check_optimizer_instance(factory, self.model)
        if factory is not None:
            return factory([p for p in self.model.parameters() if p.requires_grad])
        betas = (knobs.adam_beta1, knobs.adam_beta2)
        if knobs.optim is not None:
            from lightalign.modules.training.optimizers import build_named_optimizer

            return build_named_optimizer(knobs.optim, self.model, lr=knobs.learning_rate,
                                         weight_decay=knobs.weight_decay, betas=betas, eps=knobs.adam_epsilon,
                                         optim_args=knobs.optim_args, optim_target_modules=knobs.optim_target_modules)
        groups = decay_parameter_groups(self.model, knobs.weight_decay)
        return torch.optim.AdamW(groups, lr=knobs.learning_rate, betas=betas, eps=knobs.adam_epsilon,
                                 fused=fused_adamw_applies(groups, self._trainer))

    def create_lr_scheduler(self, optimizer: torch.optim.Optimizer,
                            total_steps: int | None = None) -> torch.optim.lr_scheduler.LRScheduler:
        """The schedule, stepped every optimizer step: ``lr_scheduler`` factory, or warmup + ``lr_scheduler_type``
        over ``total_steps`` (default: the Trainer's estimate)."""
        knobs = self.knobs.optimization
        factory = knobs.lr_scheduler
        if isinstance(factory, torch.optim.lr_scheduler.LRScheduler):
            return factory  # an instance, over the optimizer instance passed with it
        if factory is not None:
            return factory(optimizer)
        total = total_steps or (int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1)
        warmup = knobs.warmup_steps or math.ceil(knobs.warmup_ratio * total)

        def factor(step: int) -> float:
            return schedule_factor(step, total, warmup, knobs.lr_scheduler_type, knobs.min_lr_rate)

        # what continue_schedule names on resume; on the function, which LambdaLR does not checkpoint (the
        # scheduler's own attributes would come back from the checkpoint with the old run's values)
        factor.lightalign_span = (total, warmup)
        return LambdaLR(optimizer, factor)

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
