"""Sampling a group of completions per prompt with the prompt's prefill computed once.

``generate(num_return_sequences=G)`` copies every prompt ``G`` times and runs the prefill on all copies. Here
the prompts (all but their last token) go through the model once; the resulting KV cache is repeated ``G``
times along the batch and handed to ``generate``, which then only computes the last prompt token and the
completions. Position ids follow ``generate``'s own rule for left-padded prompts (``cumsum(mask) - 1``), so
the cache holds exactly what ``generate`` would have computed: the completions are the same.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache


def prefill_shared_cache(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                         repeats: int) -> DynamicCache:
    """KV cache of ``prompt_ids[:, :-1]`` (left-padded), each row repeated ``repeats`` times."""
    config = getattr(model, "config", None)
    cache = DynamicCache(config=config)
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    model(input_ids=prompt_ids[:, :-1], attention_mask=prompt_mask[:, :-1], position_ids=positions[:, :-1],
          past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(repeats)
    return cache


@torch.no_grad()
def generate_groups(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                    num_generations: int, share_prefill: bool = True, **generate_kwargs: Any) -> torch.Tensor:
    """``num_generations`` completions per prompt, rows grouped by prompt: ``[P * G, prompt_len + new]``.

    With ``share_prefill`` (and prompts of at least two tokens) the prompt prefill runs once per prompt;
    otherwise this is ``model.generate(num_return_sequences=num_generations)``.
    """
    if not share_prefill or num_generations == 1 or prompt_ids.shape[1] < 2:
        return model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                              num_return_sequences=num_generations, **generate_kwargs)
    cache = prefill_shared_cache(model, prompt_ids, prompt_mask, num_generations)
    return model.generate(
        input_ids=prompt_ids.repeat_interleave(num_generations, 0),
        attention_mask=prompt_mask.repeat_interleave(num_generations, 0),
        past_key_values=cache, **generate_kwargs,
    )
