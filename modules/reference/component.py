"""``Reference``: the reference model of a method, as one component (DPO, KTO, GRPO, RLOO, PPO use it).

It decides how the reference is made (``build_reference``): a frozen copy of the policy (default), a copy sharing
the policy's first ``num_shared_layers`` layers, a separately loaded (e.g. 8/4-bit) checkpoint
(``ref_model_name_or_path`` / ``ref_model_init_kwargs``), or none for a LoRA policy, whose reference is the base
model with the adapters disabled (``model_for``). The reference model itself is held by the LightningModule as
``ref_model``, outside its module tree (``PolicyModule``: never optimised, checkpointed or wrapped by a strategy).
Precomputed log-probs (``precompute_reference_logps``) and TR-DPO sync (``mix_into_reference``) act on that model.
"""

from __future__ import annotations

import dataclasses

from lightalign.knobs import KnobGroup, knob

import contextlib
from typing import Any, Iterator

import torch

from lightalign.modules.reference.model import build_reference, move_reference
from lightalign.modules.training.lora import is_peft_model


@dataclasses.dataclass(frozen=True)
class ReferenceKnobs(KnobGroup):
    """Where the reference model comes from (default: a frozen copy of the initial policy, or the base model with
    LoRA disabled)."""

    group = "reference"
    ref_model_name_or_path: str | None = knob(
        None, "a separately loaded reference model (a hub name or folder); default: a frozen copy of the initial "
              "policy, or the base model with the adapters disabled when the policy is LoRA. Methods with a KL "
              "coefficient build it only when the coefficient is > 0.")
    ref_model_init_kwargs: dict[str, Any] | None = knob(
        None, "``from_pretrained`` arguments of the reference, e.g. ``{quantization_config: {load_in_8bit: true}}`` "
              "(bitsandbytes) or ``{dtype: bfloat16}``; with them alone the policy's checkpoint is loaded again that "
              "way.")


@dataclasses.dataclass(frozen=True)
class SharedLayersKnobs(KnobGroup):
    """A reference that shares the policy's first layers (TRL's ``create_reference_model``)."""

    group = "shared_layers"
    num_shared_layers: int | None = knob(
        None, "share the first k decoder layers (and the embeddings) between policy and reference; they are frozen "
              "in both, the rest of the reference is a frozen copy. Not with a separately loaded reference.")

    def check(self) -> None:
        if self.num_shared_layers is not None and self.num_shared_layers < 1:
            raise ValueError(f"num_shared_layers must be >= 1 or null, got {self.num_shared_layers}.")


class Reference:
    """The reference model's recipe (how ``build`` makes it); ``from_knobs`` builds it from a method's groups."""

    @classmethod
    def from_knobs(cls, reference: ReferenceKnobs, shared: SharedLayersKnobs | None = None) -> "Reference":
        return cls(reference.ref_model_name_or_path, reference.ref_model_init_kwargs,
                   shared.num_shared_layers if shared is not None else None)

    def __init__(self, name_or_path: str | None = None, init_kwargs: dict[str, Any] | None = None,
                 num_shared_layers: int | None = None) -> None:
        if num_shared_layers is not None and (name_or_path or init_kwargs):
            raise ValueError("num_shared_layers shares the policy's own layers; it cannot be combined with a "
                             "separately loaded reference (ref_model_name_or_path / ref_model_init_kwargs).")
        self.name_or_path = name_or_path
        self.init_kwargs = init_kwargs
        self.num_shared_layers = num_shared_layers

    @property
    def separate(self) -> bool:
        """Whether the reference is loaded on its own (another checkpoint, or quantized load arguments)."""
        return bool(self.name_or_path or self.init_kwargs)

    def build(self, policy: torch.nn.Module, policy_name: str | None, trust_remote_code: bool = False
              ) -> torch.nn.Module | None:
        """The reference model of ``policy`` (None for a LoRA policy: its base model with adapters disabled)."""
        return build_reference(policy, self.name_or_path or policy_name, separate=self.separate,
                               init_kwargs=self.init_kwargs, num_shared_layers=self.num_shared_layers,
                               trust_remote_code=trust_remote_code)

    def move(self, ref: torch.nn.Module | None, device: torch.device, policy: torch.nn.Module | None) -> None:
        """Onto the module's device, in the policy's floating dtype (``model.move_reference``)."""
        move_reference(ref, device, policy, self.init_kwargs)

    @staticmethod
    @contextlib.contextmanager
    def model_for(ref: torch.nn.Module | None, policy: torch.nn.Module, policy_is_reference: bool = False
                  ) -> Iterator[torch.nn.Module]:
        """The model whose forward gives reference log-probs: ``ref``; the untrained policy itself during the one
        precompute pass that needs no copy (``policy_is_reference``); or the LoRA policy with adapters off."""
        if ref is not None:
            yield ref
        elif policy_is_reference:
            yield policy
        elif is_peft_model(policy):
            with policy.disable_adapter():
                yield policy
        else:
            raise RuntimeError("The reference model was released (precomputed log-probs) but this batch has none.")
