"""One forward per batch layout: SFT rows (padded or padding-free) and GRPO micro-batches (padded or shared-prefix).

Each function takes the model and a batch as the datamodule (or the GRPO rollout) made it and returns what the
loss needs. Which model may run which layout is checked at fit start (``adaptations.check_layout``); the
conformance matrix (tests/test_conformance.py) holds every family to these functions.
"""

from __future__ import annotations

from typing import Any

import torch

from lightalign.datamodules.shared_prefix import prompt_group_segments, shared_prefix_batch
from lightalign.modules.adaptations.attention import VARLEN_SDPA, sequence_sizes
from lightalign.modules.adaptations.support import PACKED_MASK_FAMILIES
from lightalign.modules.logprobs import forward_accepts, selective_log_softmax, shared_prefix_token_logps


def is_packed_row(batch: dict[str, Any]) -> bool:
    """A padding-free batch: one row, ``position_ids`` given and no attention mask."""
    return "position_ids" in batch and "attention_mask" not in batch and batch["input_ids"].shape[0] == 1


def split_packed_attention(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether a packed row's sequences attend one SDPA call each (``sdpa_varlen``). On CPU it is the faster way
    (measured); elsewhere only where the family's own mask would let attention cross sequences."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != VARLEN_SDPA:
        return False
    return device.type == "cpu" or getattr(config, "model_type", None) not in PACKED_MASK_FAMILIES


def sft_logits(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Logits ``[rows, T, V]`` of an SFT batch (padded, or one padding-free row with ``position_ids``)."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    if is_packed_row(batch) and split_packed_attention(model, batch["input_ids"].device):
        sizes = batch.get("sequence_sizes")  # host integers from the collator: no device read per layer
        inputs["sequence_sizes"] = list(sizes) if sizes is not None else sequence_sizes(batch["position_ids"])
    return model(**inputs, use_cache=False).logits


def padded_position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded rows, as ``generate`` counts them: ``cumsum(mask) - 1`` (padding at 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def grpo_forward(model: torch.nn.Module, mb: dict[str, Any], temperature: float = 1.0):
    """Per-token log-probs ``[B, T]`` of a GRPO micro-batch's completion tokens, the logits they came from
    (divided by ``temperature``) and the mask selecting the scored rows of those logits.

    Padded layout: ``[left-padded prompt, completion]`` rows, positions counted from each row's first real token
    (what ``generate`` used; models with learned absolute positions depend on it). Shared layout (``mb["shared"]``):
    one segment per prompt, logits only where a completion token is predicted."""
    b, t = mb["completion_ids"].shape
    if "shared" in mb:
        shared = mb["shared"]
        logps, logits = shared_prefix_token_logps(model, shared, b, t, temperature)
        return logps, logits, mb["completion_mask"][shared["target_sequence"], shared["target_offset"]].bool()
    input_ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1)
    attention_mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=t + 1)
    if forward_accepts(model, "position_ids"):
        inputs["position_ids"] = padded_position_ids(attention_mask)
    logits = model(**inputs).logits[:, :-1] / temperature  # the sampling distribution
    return selective_log_softmax(logits, mb["completion_ids"]), logits, mb["completion_mask"].bool()


def grpo_token_logps(model: torch.nn.Module, mb: dict[str, Any], temperature: float = 1.0) -> torch.Tensor:
    return grpo_forward(model, mb, temperature)[0]


def prompt_group_batch(mb: dict[str, torch.Tensor], pad_token_id: int, pack_length: int,
                       lengths: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A GRPO micro-batch in the shared-prefix layout (one segment per distinct prompt), on its device.
    ``lengths``: completion tokens per row (default: the completion mask's counts)."""
    lengths = mb["completion_mask"].sum(-1) if lengths is None else lengths
    segments = prompt_group_segments(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], lengths)
    shared = shared_prefix_batch(segments, pad_token_id, pack_length)
    device = mb["completion_ids"].device
    return {k: v.to(device) for k, v in shared.items()}
