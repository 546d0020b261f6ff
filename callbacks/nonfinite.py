"""``NonFiniteGuard``: NaN/inf gradients skip the optimizer step (or stop the run); NaN/inf weights stop the run and
are never checkpointed or exported.

``PolicyModule`` adds it itself (``configure_callbacks``), so the CLI and the Python API both get it. The gradient
check is one fused reduction per step (``torch._foreach_norm``; a per-tensor ``isfinite`` loop cost 13-25% of a
small model's step), and its per-tensor norms are kept for the module's gradient clipping of the same step
(``PolicyModule.configure_gradient_clipping``), which then needs no second pass over the gradients.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Iterable, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightalign.knobs import KnobGroup, knob

POLICIES = ("skip", "stop", "off")
MAX_SKIPPED_FRACTION = 0.5  # a run that skipped more of its optimizer steps than this did not train: it fails


@dataclasses.dataclass(frozen=True)
class NonfiniteKnobs(KnobGroup):
    """What a NaN/inf gradient does (``NonFiniteGuard``)."""

    group = "nonfinite"
    nonfinite: Literal["skip", "stop", "off"] = knob(
        "skip", "what a NaN/inf gradient does: ``skip`` the optimizer step (warning, ``train/nonfinite_steps`` "
                "counter; the weights stay finite), ``stop`` with an error naming the step, batch and parameter, or "
                "``off``. With ``16-mixed`` precision the gradient scaler handles overflows and the gradient check "
                "stays off. Unless ``off``, NaN/inf weights after a step (an update that overflowed) stop the run with "
                "an error; non-finite weights are never checkpointed or exported (``NonFiniteGuard``).")
    max_consecutive_nonfinite_steps: int | None = knob(10, "with ``nonfinite: skip``, stop with an error after this "
                                                           "many skipped steps in a row; null: never.")

    def check(self) -> None:
        if self.nonfinite not in POLICIES:
            raise ValueError(f"nonfinite='{self.nonfinite}' is unknown; use skip, stop or off.")
        if self.max_consecutive_nonfinite_steps is not None and self.max_consecutive_nonfinite_steps < 1:
            raise ValueError(f"max_consecutive_nonfinite_steps must be >= 1 or null, got "
                             f"{self.max_consecutive_nonfinite_steps}.")

class NonFiniteRunError(FloatingPointError, ValueError):
    """A run that ended without having trained (most steps skipped, a non-finite final loss): its message says
    what happened and what to do."""


def first_nonfinite(named_tensors: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """The name of the first tensor holding a NaN or inf (None when all are finite)."""
    return next((n for n, t in named_tensors if t is not None and not bool(torch.isfinite(t).all())), None)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Every element of every tensor is finite: one fused 2-norm per tensor (a NaN or inf anywhere makes it
    non-finite), one reduction over them; only when a 2-norm is not finite, which finite values far beyond 1e19
    can also cause (their squares overflow), the fused max-abs (which cannot overflow) decides. The 2-norm is the
    cheap one: on CPU the max-abs norm costs many times more, and the weight check runs after every optimizer step
    (measured, see docs/performance.md 'Non-finite check')."""
    # this rank's part: an FSDP2 DTensor's local shard (which may be empty: a [1, H] weight over 2 ranks), and ZeRO-3's
    # empty placeholders outside its gather are left out
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    if bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors))).all()):
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors, float("inf")))).all())


def holds_numbers(param: torch.Tensor) -> bool:
    """Whether a parameter's elements are numbers that can be NaN/inf: not bitsandbytes' packed 8-bit/4-bit storage
    (``Params4bit`` of a QLoRA base: its bytes, whatever dtype holds them, are codes, frozen, never updated) nor
    integer tensors (8-bit ``Int8Params``)."""
    return (param.is_floating_point() or param.is_complex()) and not hasattr(param, "quant_state")


class NonFiniteGuard(L.Callback):
    """Guards training against NaN/inf.

    Args:
        policy: what a non-finite gradient does: ``skip`` the optimizer step (the gradients are dropped, so no
            update, no weight decay, no momentum; a warning and the ``train/nonfinite_steps`` counter), ``stop``
            with an error naming the step, batch and parameter, or ``off`` (no per-step checks). With
            ``16-mixed`` precision the gradient scaler handles overflowing gradients and this check stays off.
        max_consecutive_nonfinite_steps: with ``skip``, stop with an error after this many skipped steps in a row
            (the run is no longer training); None: never.

    Unless ``off``, the weights are checked after every optimizer step too (one fused reduction): an update can
    make them non-finite from finite gradients (a learning rate far too high), and no later step can repair that,
    so the run stops with an error naming the step and the parameter. Whatever the policy, a checkpoint of
    non-finite weights is refused with an error (``PolicyModule.export_hf`` refuses them too).

    When training ends (at the last epoch end, before the final export and checkpoint), unless ``off``: a run whose
    last logged ``train/loss`` is NaN/inf, or that skipped more than half of its optimizer steps, fails with
    ``NonFiniteRunError`` (exit 1 from the console script) and writes no export; a run that skipped fewer says how
    many in the log.
    """

    def __init__(self, policy: str = "skip", max_consecutive_nonfinite_steps: int | None = 10) -> None:
        self.policy = policy
        self.max_consecutive = max_consecutive_nonfinite_steps
        self.nonfinite_steps = 0  # skipped steps of the run (checkpointed)
        self.consecutive = 0  # skipped steps since the last good one (checkpointed)
        self.grad_norms: tuple[list[torch.Tensor], torch.Tensor | None] | None = None
        self._checked_step = -1
        self._run_checked = False

    # ------------------------------------------------------------------------------------- gradients
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.grad_norms = None
        if self.policy == "off" or str(trainer.precision) == "16-mixed":
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None and p.grad.numel()]
        norms = torch.stack(torch._foreach_norm(grads)) if grads else None
        self.grad_norms = (grads, norms)  # for this step's clipping (PolicyModule.configure_gradient_clipping)
        bad = norms is not None and not bool(torch.isfinite(norms).all())
        if not _on_any_rank(trainer, pl_module, bad):
            self.consecutive = 0
            return
        name = first_nonfinite((n, p.grad) for n, p in pl_module.named_parameters()) or "(on another rank's shard)"
        where = f"optimizer step {trainer.global_step} (epoch {trainer.current_epoch}, batch " \
                f"{trainer.fit_loop.epoch_loop.batch_idx}), first in parameter '{name}'"
        if self.policy == "stop":
            raise FloatingPointError(
                f"Non-finite gradient at {where}. Lower the learning rate, enable gradient_clip_val, check the data "
                "of that batch, or set nonfinite: skip to skip such steps."
            )
        self.grad_norms = None
        for p in pl_module.parameters():
            p.grad = None  # optimizers skip parameters without gradients: no update, no weight decay, no momentum
        self.nonfinite_steps += 1
        self.consecutive += 1
        if self.max_consecutive is not None and self.consecutive >= self.max_consecutive:
            raise FloatingPointError(
                f"{self.consecutive} optimizer steps in a row had non-finite gradients (the last at {where}); the run "
                "is no longer training. Lower the learning rate, enable gradient_clip_val, or resume from an earlier "
                "checkpoint (max_consecutive_nonfinite_steps sets this limit)."
            )
        warnings.warn(f"Skipped {where}: non-finite gradient ({self.nonfinite_steps} skipped so far).", stacklevel=2)
        pl_module.log("train/nonfinite_steps", float(self.nonfinite_steps), on_step=True)

    def take_grad_norms(self) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
        """This step's gradients and their per-tensor norms (once; None if the check did not run)."""
        cached, self.grad_norms = self.grad_norms, None
        return cached

    # ------------------------------------------------------------------------------------- weights
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.grad_norms = None
        step = trainer.global_step
        if self.policy == "off" or step == self._checked_step or step == 0:
            return  # still accumulating: no optimizer step since the last check
        self._checked_step = step
        cause = ""
        if str(trainer.precision) != "16-mixed":
            cause = ("The step's gradients were finite, so the update itself overflowed: the learning rate is far too "
                     "high (or the optimizer state is broken). ")
        self.check_weights(trainer, pl_module, f"after optimizer step {step} (epoch {trainer.current_epoch})", cause)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.check_weights(trainer, pl_module, f"in the checkpoint of step {trainer.global_step}",
                           "The checkpoint is not written, so the previous one stays the last good state. ")

    def check_weights(self, trainer: L.Trainer, pl_module: L.LightningModule, where: str, explanation: str = "") -> None:
        """Stop with an error naming the parameter if any weight (this rank's shard, any rank) is NaN/inf."""
        bad = not all_finite([p.detach() for p in pl_module.parameters() if holds_numbers(p)])
        if not _on_any_rank(trainer, pl_module, bad):
            return
        name = first_nonfinite((n, p.detach()) for n, p in pl_module.named_parameters() if holds_numbers(p)) \
            or "(on another rank's shard)"
        raise FloatingPointError(
            f"Non-finite weights {where}: parameter '{name}' holds NaN/inf. {explanation}Lower the learning rate, "
            "then resume from the last checkpoint (its weights are finite) or start over."
        )

    # ------------------------------------------------------------------------------------- end of the run
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._run_checked = False

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the last epoch end comes before on_train_end, where the export and the final checkpoint are written
        loop = trainer.fit_loop
        max_epochs = trainer.max_epochs
        if (trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step) or trainer.should_stop \
                or (max_epochs is not None and 0 <= max_epochs <= loop.epoch_progress.current.processed):
            self.check_run(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check_run(trainer, pl_module)

    def check_run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Fail a run that ended without training (see the class docstring); say how many steps were skipped."""
        if self.policy == "off" or self._run_checked:
            return
        self._run_checked = True
        steps, skipped = trainer.global_step, self.nonfinite_steps
        loss = trainer.callback_metrics.get("train/loss")
        loss = float(loss) if loss is not None else None
        # every rank must take the same decision (a rank that raised alone would leave the others waiting)
        if _on_any_rank(trainer, pl_module, loss is not None and not math.isfinite(loss)):
            raise NonFiniteRunError(
                f"Training ended with a non-finite train/loss ({loss}) at step {steps} ({skipped} of {steps} optimizer "
                "steps skipped for non-finite gradients): the model is not exported. Lower the learning rate or "
                "enable gradient_clip_val, and check the data; resume from an earlier checkpoint or start over.")
        if steps > 0 and skipped > MAX_SKIPPED_FRACTION * steps:
            raise NonFiniteRunError(
                f"{skipped} of {steps} optimizer steps were skipped for non-finite gradients (more than half): the run "
                "did not train, so the model is not exported. Lower the learning rate or enable gradient_clip_val, "
                "and check the data; resume from an earlier checkpoint or start over.")
        if skipped:
            rank_zero_warn(f"{skipped} of {steps} optimizer steps were skipped for non-finite gradients "
                           "(train/nonfinite_steps); the others trained.")

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"nonfinite_steps": self.nonfinite_steps, "consecutive": self.consecutive}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.nonfinite_steps = int(state_dict.get("nonfinite_steps", 0))
        self.consecutive = int(state_dict.get("consecutive", 0))


def _on_any_rank(trainer: L.Trainer, pl_module: L.LightningModule, flag: bool) -> bool:
    """``flag`` on any rank: sharded strategies (FSDP) give each rank its own slice of the weights and gradients,
    and every rank must make the same skip/stop decision, so one scalar all-reduce settles it (every rank calls)."""
    if trainer.world_size <= 1:
        return flag
    value = torch.tensor(float(flag), device=pl_module.device)
    return bool(trainer.strategy.reduce(value, reduce_op="sum") > 0)
