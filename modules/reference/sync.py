"""TR-DPO reference updates (TRL's ``sync_ref_model``): every ``ref_model_sync_steps`` optimizer steps the
reference becomes ``ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * reference``, parameter by
parameter (the callback that times it and keeps the mixed weights in checkpoints: ``ReferenceSync``).

Only a reference held as its own full-precision model can be mixed; the other reference modes are refused when
the module is built (``check_reference_sync``) or at fit start (``check_mixable``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightalign.knobs import KnobGroup, knob


@dataclasses.dataclass(frozen=True)
class ReferenceSyncKnobs(KnobGroup):
    """TR-DPO's periodic update of the reference model (``ReferenceSync``)."""

    group = "reference_sync"
    sync_ref_model: bool = knob(
        False, "methods with a reference model (DPO, GRPO): every ``ref_model_sync_steps`` optimizer steps the "
               "reference becomes ``ref_model_mixup_alpha * policy + (1 - alpha) * reference`` (TR-DPO); kept in "
               "checkpoints. Not with precomputed reference log-probs, LoRA, a quantized reference or FSDP/ZeRO-3.")
    ref_model_mixup_alpha: float = knob(0.6, "the mix's alpha (default 0.6).")
    ref_model_sync_steps: int = knob(512, "optimizer steps between mixes (default 512).")

    def check(self) -> None:
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise ValueError(f"ref_model_mixup_alpha must lie in [0, 1] (TR-DPO's alpha; default 0.6), got "
                             f"{self.ref_model_mixup_alpha}.")
        every = self.ref_model_sync_steps
        if int(every) != every or every < 1:
            raise ValueError(f"ref_model_sync_steps must be an integer >= 1 (optimizer steps; default 512), got {every}.")


PRECOMPUTED = ("precompute_ref_log_probs=True computes the reference log-probs once before training, and a reference "
               "that changes during training would make them stale; set precompute_ref_log_probs=False")
LORA = ("with LoRA (peft_config) the reference is the base model with the adapters disabled, not a model of its own "
        "whose weights could be rewritten; train without peft_config to update the reference")


def refuse_reference_sync(why: str | None) -> None:
    """``sync_ref_model`` refused, at construction, for the reason a method gives (``reference_sync_blocker``)."""
    if why:
        raise ValueError(f"sync_ref_model=True cannot work here: {why}. Drop sync_ref_model (and its "
                         "ref_model_mixup_alpha / ref_model_sync_steps).")


def quantized_reference(init_kwargs: dict[str, Any] | None) -> str | None:
    """Why a reference loaded with a ``quantization_config`` cannot be mixed (None: it is not quantized)."""
    if (init_kwargs or {}).get("quantization_config") is not None:
        return "a quantized reference (ref_model_init_kwargs.quantization_config) cannot take a mix of float weights"
    return None


def refuse_sharded_reference(strategy: Any, knob: str = "sync_ref_model") -> None:
    """At setup: ``knob`` (a reference rewritten from the policy's weights) is refused under FSDP / ZeRO-3, where
    each rank holds a shard of the policy's parameters while the reference is whole."""
    name = type(strategy).__name__
    if "FSDP" in name or getattr(strategy, "zero_stage_3", False):
        raise ValueError(f"{knob}=True is not supported with {name} (ZeRO-3 / FSDP): the policy's parameters are "
                         f"sharded across ranks while the reference is whole. Use DDP or DeepSpeed ZeRO-1/2, or drop "
                         f"{knob}.")


def check_mixable(policy: torch.nn.Module, reference: torch.nn.Module | None, knob: str = "sync_ref_model") -> None:
    """At fit start: the reference exists and has the policy's parameter names and shapes (``knob`` writes the
    policy's weights, or an average of them, into it parameter by parameter)."""
    if reference is None:
        raise ValueError(f"{knob}=True but this run has no reference model in memory to update.")
    mine = {n: p.shape for n, p in policy.named_parameters()}
    theirs = {n: p.shape for n, p in reference.named_parameters()}
    if mine != theirs:
        differ = sorted(set(mine) ^ set(theirs)) or [n for n in mine if mine[n] != theirs[n]]
        raise ValueError(
            f"{knob}=True writes the policy's weights into the reference parameter by parameter, but the reference "
            f"(ref_model_name_or_path) has other parameters (e.g. {differ[:2]}). Use a reference of the policy's "
            f"architecture, or drop {knob}."
        )


@torch.no_grad()
def mix_into_reference(policy: torch.nn.Module, reference: torch.nn.Module, alpha: float) -> int:
    """``reference <- alpha * policy + (1 - alpha) * reference`` for every parameter; returns how many were mixed.
    Tensors the two models share (``num_shared_layers``) are the same values already and are left alone."""
    mixed = 0
    policy_params = dict(policy.named_parameters())
    for name, ref_param in reference.named_parameters():
        param = policy_params[name]
        if param is ref_param:
            continue
        ref_param.mul_(1.0 - alpha).add_(param.detach().to(ref_param.dtype), alpha=alpha)
        mixed += 1
    return mixed
