"""The log-prob forward of a rollout micro-batch (GRPO, RLOO, PPO; distillation's packed rows), in each layout:
padded ``[left-padded prompt, completion]`` rows, one segment per prompt (shared prefix), or one padding-free row
(``adaptations.layouts`` builds the last two)."""

from __future__ import annotations

from typing import Any

import torch

from lightalign.modules.adaptations.layouts import split_packed_attention
from lightalign.modules.training.logprobs import (forward_accepts, forward_positions, prompt_image_kwargs,
                                                  scatter_to_sequences, selective_log_softmax,
                                                  shared_prefix_token_logps)


def grpo_forward(model: torch.nn.Module, mb: dict[str, Any], temperature: float = 1.0):
    """Per-token log-probs ``[B, T]`` of a GRPO micro-batch's completion tokens, the logits they came from
    (divided by ``temperature``) and the mask selecting the scored rows of those logits.

    Padded layout: ``[left-padded prompt, completion]`` rows, positions counted from each row's first real token
    (what ``generate`` used; models with learned absolute positions depend on it), with each row's prompt images
    (``prompt_image_kwargs``; an mRoPE model then computes its own positions). Shared layout (``mb["shared"]``):
    one segment per prompt, logits only where a completion token is predicted. Padding-free layout
    (``mb["packed"]``, ``packed_completion_batch``): every ``[prompt, completion]`` one after the other in one row,
    positions from 0 for each, one attention call per sequence; logits only where a completion token is predicted.
    In both the logits are ``[targets, V]`` and the mask says which of them the loss scores."""
    b, t = mb["completion_ids"].shape
    if "packed" in mb:
        packed = mb["packed"]
        logps, logits = packed_token_logps(model, packed, b, t, temperature)
        return logps, logits, mb["completion_mask"][packed["target_sequence"], packed["target_offset"]].bool()
    if "shared" in mb:
        shared = mb["shared"]
        logps, logits = shared_prefix_token_logps(model, shared, b, t, temperature)
        return logps, logits, mb["completion_mask"][shared["target_sequence"], shared["target_offset"]].bool()
    input_ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1)
    # a tool rollout's loss mask leaves out the tool results, which its attention mask keeps
    attention_mask = torch.cat([mb["prompt_mask"], mb.get("completion_attention_mask", mb["completion_mask"])], dim=1)
    images = prompt_image_kwargs(model, mb, t)  # the prompts' images (none for text rows)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=t + 1,
                  **images, **forward_positions(model, attention_mask, images))
    logits = model(**inputs).logits[:, :-1] / temperature  # the sampling distribution
    return selective_log_softmax(logits, mb["completion_ids"]), logits, mb["completion_mask"].bool()


def grpo_token_logps(model: torch.nn.Module, mb: dict[str, Any], temperature: float = 1.0) -> torch.Tensor:
    return grpo_forward(model, mb, temperature)[0]


def packed_logits(model: torch.nn.Module, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """The ``[targets, V]`` logits (untempered) of a padding-free batch (``packed_completion_batch``), row ``j``
    predicting ``packed["targets"][j]``: one forward of the packed row, logits only at ``logits_index``."""
    inputs = {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"], "use_cache": False}
    if split_packed_attention(model, packed["input_ids"].device):
        inputs["sequence_sizes"] = packed["sequence_sizes"].tolist()  # host integers, read once per forward
    index = packed["logits_index"]
    if forward_accepts(model, "logits_to_keep"):
        logits = model(**inputs, logits_to_keep=index).logits[0]
        if logits.shape[0] != index.shape[0]:  # a model that ignores an index tensor returns every position
            logits = logits[index]
        return logits
    return model(**inputs).logits[0, index]


def packed_token_logps(model: torch.nn.Module, packed: dict[str, torch.Tensor], num_sequences: int, width: int,
                       temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs ``[num_sequences, width]`` of a padding-free GRPO batch's completion tokens (0 where a
    row has none) and the ``[targets, V]`` logits they came from (divided by ``temperature``)."""
    logits = packed_logits(model, packed) / temperature  # the sampling distribution
    logps = selective_log_softmax(logits, packed["targets"])
    return scatter_to_sequences(logps, packed, num_sequences, width)[0], logits
