"""``Reference``: the reference model of a method, as one component (DPO, KTO, GRPO, RLOO, PPO use it).

It decides how the reference is made (``build_reference``): a frozen copy of the policy (default), a copy sharing
the policy's first ``num_shared_layers`` layers, a separately loaded (e.g. 8/4-bit) checkpoint
(``ref_model_name_or_path`` / ``ref_model_init_kwargs``), or none for a LoRA policy, whose reference is the base
model with the adapters disabled (``model_for``). The reference model itself is held by the LightningModule as
``ref_model``, outside its module tree (``PolicyModule``: never optimised, checkpointed or wrapped by a strategy).
Precomputed log-probs (``precompute_reference_logps``) and TR-DPO sync (``mix_into_reference``) act on that model.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from lightalign.modules.reference.model import build_reference, move_reference
from lightalign.modules.training.lora import is_peft_model


class Reference:
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
