"""The teacher of distillation (``TeacherKnobs``): a separately loaded frozen model, built, frozen and placed by
``Reference`` as a separately loaded reference is."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightalign.knobs import KnobGroup, knob


@dataclasses.dataclass(frozen=True)
class TeacherKnobs(KnobGroup):
    """Which model is the teacher: its folder or hub name, or (Python API) a built model."""

    group = "teacher"
    teacher_model_name_or_path: str | None = knob(
        None, "the teacher: a hub name or a local folder with ``config.json`` and weights. Its vocabulary must be the "
              "student's (checked from both configs before any weights load), unless ``GOLDModule``'s "
              "``use_uld_loss`` distils across tokenizers.")
    teacher_model: torch.nn.Module | None = knob(
        None, "an already built teacher model (Python API only), instead of ``teacher_model_name_or_path``.",
        saved=False)
    teacher_model_init_kwargs: dict[str, Any] | None = knob(
        None, "``from_pretrained`` arguments of the teacher (``dtype``, an 8/4-bit ``quantization_config`` ...), as "
              "for a separately loaded reference model. The teacher is frozen, always in eval mode, held outside the "
              "module (never optimised nor checkpointed) and placed like the reference.")

    def check(self) -> None:
        if self.teacher_model is None and not self.teacher_model_name_or_path:
            raise ValueError("DistillModule needs a teacher: teacher_model_name_or_path (a hub name or a local folder) "
                             "or, in Python, teacher_model (a built model).")
        if self.teacher_model is not None and self.teacher_model_name_or_path:
            raise ValueError("Pass either teacher_model_name_or_path or teacher_model (a built model), not both.")
