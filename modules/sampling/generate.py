"""The ``generate`` backend: a group of completions per prompt with the prompt's prefill computed once.

``generate(num_return_sequences=G)`` copies every prompt ``G`` times and runs the prefill on all copies. Here
the prompts (all but their last token) go through the model once; the resulting KV cache is repeated ``G``
times along the batch and handed to ``generate``, which then only computes the last prompt token and the
completions. Position ids follow ``generate``'s own rule for left-padded prompts (``cumsum(mask) - 1``), so
the cache holds exactly what ``generate`` would have computed: the completions are the same.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from transformers import DynamicCache

from lightalign.modules.training.logprobs import image_token_ids


# The sampling knobs every backend gives generate()'s meaning (the others are generate()-only GenerationConfig fields).
SAMPLING_KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

def forward_cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword ``model``'s forward takes its KV cache under: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` still works but is deprecated, with a FutureWarning), ``past_key_values`` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # (a PEFT forward takes **kwargs)
    try:
        return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    except (TypeError, ValueError):
        return "past_key_values"


@functools.cache
def generate_cache_kwarg() -> str:
    """The keyword ``generate`` takes a prefilled KV cache under: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` is deprecated), ``past_key_values`` before. Read from the signature of
    ``GenerationMixin.prepare_inputs_for_generation``, which names the cache it hands to the model."""
    from transformers import GenerationMixin

    parameters = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def prefill_shared_cache(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                         repeats: int) -> DynamicCache:
    """KV cache of ``prompt_ids[:, :-1]`` (left-padded), each row repeated ``repeats`` times."""
    config = getattr(model, "config", None)
    cache = DynamicCache(config=config)
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    model(input_ids=prompt_ids[:, :-1], attention_mask=prompt_mask[:, :-1], position_ids=positions[:, :-1],
          use_cache=True, logits_to_keep=1, **{forward_cache_kwarg(model): cache})
    cache.batch_repeat_interleave(repeats)
    return cache


@torch.no_grad()
def generate_groups(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                    num_generations: int, share_prefill: bool = True, return_logprobs: bool = False,
                    prompt_inputs: dict[str, torch.Tensor] | None = None, **generate_kwargs: Any):
    """``num_generations`` completions per prompt, rows grouped by prompt: ``[P * G, prompt_len + new]``.

    With ``share_prefill`` (and prompts of at least two tokens) the prompt prefill runs once per prompt;
    otherwise this is ``model.generate(num_return_sequences=num_generations)``. With ``return_logprobs`` also the
    sampler's log-prob of each new token ``[P * G, new]`` (``generate``'s processed scores: the distribution sampled
    from), as ``(sequences, logprobs)``.

    ``prompt_inputs``: image prompts' inputs, their rows already repeated ``num_generations`` times
    (``repeated_prompt_inputs``): every prompt row is repeated likewise (``repeat_interleave``) and ``generate`` runs
    on the copies with their images (the model computes its own positions: mRoPE); no prefill is shared, and the
    image placeholder tokens are never sampled (``image_token_ids``; TRL suppresses them too), since a sampled one
    would have no image to stand for."""
    if return_logprobs:
        generate_kwargs.update(output_scores=True, return_dict_in_generate=True)
    if prompt_inputs:
        suppressed = sorted({*(generate_kwargs.pop("suppress_tokens", None) or ()), *image_token_ids(model)})
        out = model.generate(input_ids=prompt_ids.repeat_interleave(num_generations, 0),
                             attention_mask=prompt_mask.repeat_interleave(num_generations, 0),
                             **prompt_inputs, suppress_tokens=suppressed or None, **generate_kwargs)
    elif not share_prefill or num_generations == 1 or prompt_ids.shape[1] < 2:
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                             num_return_sequences=num_generations, **generate_kwargs)
    else:
        cache = prefill_shared_cache(model, prompt_ids, prompt_mask, num_generations)  # text prompts only
        out = model.generate(
            input_ids=prompt_ids.repeat_interleave(num_generations, 0),
            attention_mask=prompt_mask.repeat_interleave(num_generations, 0),
            **{generate_cache_kwarg(): cache}, **generate_kwargs,
        )
    if not return_logprobs:
        return out
    new = out.sequences[:, prompt_ids.shape[1]:]
    scores = torch.stack(out.scores, 1).float()  # [P * G, new, V]
    logps = torch.log_softmax(scores, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
    return out.sequences, logps

