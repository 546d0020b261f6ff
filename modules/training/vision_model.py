"""The vision half of a vision-language policy: which modules are the vision tower and the projector, and the knobs
that keep them fixed (``VisionModelKnobs``), read where the policy is prepared (``ModelBuilding``).

The modules are found by name, the names transformers' VLM classes give them: the tower is ``visual`` (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL), ``vision_tower`` (Gemma 3, LLaVA) or ``vision_model`` (Idefics3/SmolVLM); the projector that
maps its features into the language model is ``multi_modal_projector`` (Gemma 3, LLaVA), ``connector``
(Idefics3/SmolVLM), or, inside Qwen's tower, ``merger`` (and Qwen3-VL's ``deepstack_merger_list``). Everything else
(the language model, its embeddings, the head) is the language model.

With LoRA (``peft_config``), a frozen part also gets no adapters (its modules join peft's ``exclude_modules``): with
both knobs on, LoRA trains the language model only."""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import torch

from lightalign.knobs import KnobGroup, knob

VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "merger", "deepstack_merger_list", "mm_projector")


@dataclasses.dataclass(frozen=True)
class VisionModelKnobs(KnobGroup):
    """What of a vision-language model trains (a text-only model refuses these knobs)."""

    group = "vision_model"
    freeze_vision_tower: bool = knob(False, "vision-language models: keep the vision tower's weights fixed (no "
                                            "gradient; with LoRA, no adapters in it).")
    freeze_multi_modal_projector: bool = knob(
        False, "vision-language models: keep the projector from image features to the language model fixed "
               "(``multi_modal_projector``, ``connector``, Qwen's ``merger``); with ``freeze_vision_tower`` and "
               "``peft_config``: LoRA on the language model only.")

    @property
    def any(self) -> bool:
        return self.freeze_vision_tower or self.freeze_multi_modal_projector


def vision_parts(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """The module names of the vision tower(s) and of the projector(s) of ``model`` (outermost matches only)."""
    towers, projectors = [], []
    for name, _ in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        inside = lambda found: any(name.startswith(f + ".") for f in found)  # noqa: E731
        if last in VISION_TOWER_NAMES and not inside(towers) and not inside(projectors):
            towers.append(name)
        elif last in PROJECTOR_NAMES and not inside(projectors):
            projectors.append(name)
    return towers, projectors


def frozen_modules(model: torch.nn.Module, knobs: VisionModelKnobs) -> list[str]:
    """The module names the knobs freeze (the tower without a projector inside it; the projector)."""
    towers, projectors = vision_parts(model)
    if knobs.any and not towers:
        raise ValueError(f"freeze_vision_tower / freeze_multi_modal_projector: {type(model).__name__} has no module "
                         f"named {' / '.join(VISION_TOWER_NAMES)}, so its vision tower cannot be found: it is not a "
                         "vision-language model lightalign knows. Remove the knob.")
    if knobs.freeze_multi_modal_projector and not projectors:
        raise ValueError(f"freeze_multi_modal_projector: {type(model).__name__} has no module named "
                         f"{' / '.join(PROJECTOR_NAMES)}. Remove the knob.")
    return (towers if knobs.freeze_vision_tower else []) + (projectors if knobs.freeze_multi_modal_projector else [])


def _under(name: str, roots: list[str]) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


def freeze_vision(model: torch.nn.Module, knobs: VisionModelKnobs) -> list[str]:
    """Set ``requires_grad=False`` on the parameters the knobs freeze; a projector inside a tower stays trainable
    unless ``freeze_multi_modal_projector``. Returns the frozen parameter names."""
    if not knobs.any:
        return []
    roots = frozen_modules(model, knobs)
    _, projectors = vision_parts(model)
    keep = [] if knobs.freeze_multi_modal_projector else projectors
    frozen = []
    for name, param in model.named_parameters():
        if _under(name, roots) and not _under(name, keep):
            param.requires_grad_(False)
            frozen.append(name)
    return frozen


def excluding_frozen(peft_config: Any, model: torch.nn.Module, knobs: VisionModelKnobs) -> Any:
    """``peft_config`` whose ``exclude_modules`` also covers every module of the frozen parts (no adapters there):
    one regular expression (peft full-matches it against each module name), the user's own exclusions kept in it."""
    if not knobs.any:
        return peft_config
    roots = frozen_modules(model, knobs)
    _, projectors = vision_parts(model)
    keep = [] if knobs.freeze_multi_modal_projector else [p for p in projectors if _under(p, roots)]
    alternation = lambda names: "(?:" + "|".join(re.escape(n) for n in names) + ")"  # noqa: E731
    ours = (f"(?!{alternation(keep)}(?:\\.|$))" if keep else "") + alternation(roots) + "(?:\\..*)?"
    given = peft_config.get("exclude_modules") if isinstance(peft_config, dict) else getattr(
        peft_config, "exclude_modules", None)
    if isinstance(given, str):
        pattern = f"(?:{given})|(?:{ours})"
    elif given:  # peft's list form: a module whose name is, or ends with ".", one of them
        pattern = f"(?:.*\\.)?{alternation(given)}|(?:{ours})"
    else:
        pattern = ours
    if isinstance(peft_config, dict):
        return {**peft_config, "exclude_modules": pattern}
    out = copy.copy(peft_config)
    out.exclude_modules = pattern
    return out


def check_vision_model(knobs: VisionModelKnobs, model: torch.nn.Module | None, name_or_path: str | None,
                       trust_remote_code: bool = False) -> None:
    """Refuse the knobs for a text-only model, before any weight loads (reads the config only)."""
    if not knobs.any:
        return
    from lightalign.hub import is_vision_language_config, is_vision_language_model

    vlm = (is_vision_language_config(model.config) if model is not None and hasattr(model, "config")
           else is_vision_language_model(name_or_path, trust_remote_code=trust_remote_code))
    if not vlm:
        on = [k for k in ("freeze_vision_tower", "freeze_multi_modal_projector") if getattr(knobs, k)]
        raise ValueError(f"{' and '.join(on)} apply to a vision-language model, and "
                         f"'{name_or_path or type(model).__name__}' is a text-only model: remove {' / '.join(on)}.")
