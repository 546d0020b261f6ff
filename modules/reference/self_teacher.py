"""The teacher of self-distillation (SDFT, SDPO): the policy itself, as ``SelfTeacherKnobs.teacher_model_kind``
says: ``base`` a frozen copy of the initial policy (a LoRA policy: its base model with the adapters disabled),
``live`` the policy being trained (read without gradients), ``ema`` a copy that follows the policy,
``teacher <- teacher_update_rate * policy + (1 - teacher_update_rate) * teacher`` every ``teacher_sync_steps``
optimizer steps (TRL's ``SyncTeacherModelCallback``).

The copy is made, frozen and placed by ``Reference`` as a reference model is, and held in the module's reference
slot (``ref_model``: never optimised, checkpointed with the module or wrapped by a strategy); the EMA update is
TR-DPO's mix (``mix_into_reference``) run by ``TeacherEMA``, which keeps the moving teacher in checkpoints so a
resumed run continues from the teacher the uninterrupted run had.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Literal

import lightning as L
import torch

from lightalign.callbacks.reference_sync import ReferenceSync
from lightalign.knobs import KnobGroup, knob
from lightalign.modules.reference.component import Reference

TEACHER_KINDS = ("base", "live", "ema")


@dataclasses.dataclass(frozen=True)
class SelfTeacherKnobs(KnobGroup):
    """Which weights the self-distillation teacher runs with (TRL 1.16's SDFT/SDPO names; defaults per method)."""

    group = "self_teacher"
    teacher_model_kind: Literal["base", "live", "ema"] = knob(
        "base", "the teacher's weights: ``base`` the initial policy (a frozen copy; with LoRA the base model, adapters "
                "off), ``live`` the policy as it trains (no copy), ``ema`` a copy following the policy by an "
                "exponential moving average (``teacher_update_rate`` every ``teacher_sync_steps``; not with LoRA). "
                "SDFT's default base; SDPO's ema.")
    teacher_update_rate: float = knob(
        0.05, "with ``teacher_model_kind: ema``: after the update the teacher is ``rate * policy + (1 - rate) * "
              "teacher`` (1.0: a hard copy of the policy every ``teacher_sync_steps``).")
    teacher_sync_steps: int = knob(1, "with ``teacher_model_kind: ema``: optimizer steps between teacher updates.")

    def check(self) -> None:
        if self.teacher_model_kind not in TEACHER_KINDS:
            raise ValueError(f"teacher_model_kind must be one of {TEACHER_KINDS}, got {self.teacher_model_kind!r}.")
        if not 0.0 < self.teacher_update_rate <= 1.0:
            raise ValueError(f"teacher_update_rate must lie in (0, 1] (the policy's share in each EMA update), got "
                             f"{self.teacher_update_rate}.")
        every = self.teacher_sync_steps
        if int(every) != every or every < 1:
            raise ValueError(f"teacher_sync_steps must be an integer >= 1 (optimizer steps), got {every}.")


def check_self_teacher(knobs: SelfTeacherKnobs, peft_config: object | None) -> None:
    """At construction: an EMA teacher is a full copy mixed parameter by parameter, which a LoRA policy does not
    have (TRL keeps a second adapter instead; not here)."""
    if knobs.teacher_model_kind == "ema" and peft_config is not None:
        raise ValueError("teacher_model_kind 'ema' keeps a full copy of the policy mixed parameter by parameter, which "
                         "a LoRA policy (peft_config) does not have: use teacher_model_kind 'base' (the base model, "
                         "adapters off) or 'live', or train without peft_config.")


def build_self_teacher(kind: str, policy: torch.nn.Module, policy_name: str | None,
                       trust_remote_code: bool = False) -> torch.nn.Module | None:
    """The teacher's own model: a frozen copy of ``policy`` (``base``, ``ema``), or None (``live``; ``base`` of a LoRA
    policy: its adapters disabled)."""
    if kind == "live":
        return None
    return Reference().build(policy, policy_name, trust_remote_code)


@contextlib.contextmanager
def self_teacher_model(kind: str, teacher: torch.nn.Module | None, policy: torch.nn.Module
                       ) -> Iterator[torch.nn.Module]:
    """The model whose forward (the caller's, without gradients) gives the teacher's logits."""
    if kind == "live":
        yield policy
        return
    with Reference.model_for(teacher, policy) as model:
        yield model


def self_teacher_callbacks(knobs: SelfTeacherKnobs) -> list[L.Callback]:
    """The callbacks the teacher kind needs: ``TeacherEMA`` for ``ema``, none for ``base`` and ``live``."""
    if knobs.teacher_model_kind == "ema":
        return [TeacherEMA(knobs.teacher_update_rate, knobs.teacher_sync_steps)]
    return []


class TeacherEMA(ReferenceSync):
    """``teacher_model_kind: ema``: the teacher copy (in the reference slot) takes ``teacher_update_rate`` of the
    policy after every ``teacher_sync_steps``-th optimizer step; checkpoints carry it (``ReferenceSync``'s state)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._module = pl_module
        name = type(trainer.strategy).__name__
        if "FSDP" in name or getattr(trainer.strategy, "zero_stage_3", False):
            raise ValueError(f"teacher_model_kind 'ema' is not supported with {name} (ZeRO-3 / FSDP): the policy's "
                             "parameters are sharded across ranks while the teacher copy is whole. Use DDP or "
                             "DeepSpeed ZeRO-1/2, or teacher_model_kind 'base' / 'live'.")
