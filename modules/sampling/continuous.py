"""The ``continuous`` generation backend: transformers' continuous batching (``model.generate_batch``).

A paged KV cache holds every request; each forward step batches whatever requests are still running, so a
completion that emits EOS leaves the batch at once instead of being decoded as padding until the group's longest
one ends. ``num_return_sequences`` forks a prompt's ``num_generations`` requests after one prefill (prefix sharing).
Sampling runs in transformers' background thread on the default torch generator, seeded from it: seeded runs
reproduce.

The cache is sized from the rollout (its requests times prompt + ``max_new_tokens``), not from the machine's free
memory as transformers does when ``num_blocks`` / ``max_batch_tokens`` are unset (on a CPU that is a share of all
RAM); ``transformers_continuous_batching_config`` overrides any of these.
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch


def cache_sizing(num_requests: int, longest_prompt: int, prompt_tokens: int, max_new_tokens: int,
                 page_size: int = 32) -> dict[str, int]:
    """``ContinuousBatchingConfig`` sizes that fit one rollout: a page per ``page_size`` tokens of every request
    (prompt + completion; the shared prompt pages are a bonus), every request and the whole prefill in one step."""
    pages = math.ceil((longest_prompt + max_new_tokens) / page_size) + 1
    return {"page_size": page_size, "num_blocks": num_requests * pages,
            "max_batch_tokens": max(prompt_tokens, num_requests), "max_requests_per_batch": num_requests}


@contextmanager
def plain_sdpa(model: torch.nn.Module) -> Iterator[None]:
    """``sdpa`` for the duration: continuous batching accepts sdpa, eager or flash attention, not lightalign's
    ``sdpa_varlen`` (which equals ``sdpa`` on these unpacked batches); restored after."""
    from lightalign.modules.adaptations.attention import VARLEN_SDPA

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "_attn_implementation", None) != VARLEN_SDPA:
        yield
        return
    base.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        base.set_attn_implementation(VARLEN_SDPA)


@torch.no_grad()
def continuous_batching_groups(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                               num_generations: int, *, eos_token_ids: list[int], pad_token_id: int,
                               max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                               min_p: float | None, config: dict[str, Any] | None = None,
                               return_logprobs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Completion ids ``[P * G, longest]`` (rows grouped by prompt, ``pad_token_id`` after each completion's end) and,
    with ``return_logprobs``, the sampler's log-prob of each token ``[P * G, longest]`` (0 after the end)."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
    generation_config = GenerationConfig(
        do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_new_tokens=max_new_tokens,
        num_return_sequences=num_generations, eos_token_id=eos_token_ids, pad_token_id=pad_token_id)
    sizes = cache_sizing(len(prompts) * num_generations, max(map(len, prompts)), sum(map(len, prompts)),
                         max_new_tokens, page_size=(config or {}).get("page_size", 32))
    cb_config = ContinuousBatchingConfig(**{**sizes, **(config or {}), "return_logprobs": return_logprobs,
                                            "seed": int(torch.randint(0, 2**31 - 1, ()).item())})
    # transformers runs a full gc.collect() (twice) when the manager stops: seconds in a training process. Frozen
    # objects are skipped by it, so only this call's garbage is collected.
    gc.freeze()
    try:
        with plain_sdpa(model):
            outputs = model.generate_batch(prompts, generation_config=generation_config,
                                           continuous_batching_config=cb_config, progress_bar=False, warmup=False)
    finally:
        gc.unfreeze()
    expected = len(prompts) * num_generations
    failed = [o.error for o in outputs.values() if o.error is not None]
    if len(outputs) != expected or failed:  # generate_batch logs errors and returns what it has: never train on that
        raise RuntimeError(f"transformers continuous batching returned {len(outputs)} of {expected} completions"
                           + (f" ({failed[0]})" if failed else "") + "; use generation_backend: generate.")
    rows = list(outputs.values())  # a prompt's forks, then the prompt's own request: grouped by prompt
    longest = max(len(o.generated_tokens) for o in rows)
    ids = torch.full((expected, longest), pad_token_id, dtype=torch.long)
    logps = torch.zeros(expected, longest) if return_logprobs else None
    for i, out in enumerate(rows):
        n = len(out.generated_tokens)
        ids[i, :n] = torch.tensor(out.generated_tokens, dtype=torch.long)
        if logps is not None:
            logps[i, :n] = torch.tensor(out.logprobs[:n])
    device = prompt_ids.device
    return ids.to(device), None if logps is None else logps.to(device)


# ContinuousBatchingConfig fields the rollout sets itself, with what to use instead.
OWNED_CONTINUOUS_KEYS = {
    "return_logprobs": "nothing: the rollout asks for the sampler's log-probs when it needs them",
    "seed": "the run's seed (seed_everything): a fixed seed would sample the same completions in every rollout",
}


def check_continuous_config(config: Any) -> None:
    """``transformers_continuous_batching_config``: a mapping of ``ContinuousBatchingConfig`` fields the rollout does
    not set itself."""
    if not isinstance(config, dict):
        raise ValueError(f"transformers_continuous_batching_config must be a mapping of ContinuousBatchingConfig "
                         f"fields, got {type(config).__name__}.")
    from transformers.generation import ContinuousBatchingConfig

    fields = ContinuousBatchingConfig.__dataclass_fields__
    for key in config:
        if key in OWNED_CONTINUOUS_KEYS:
            raise ValueError(f"transformers_continuous_batching_config sets {key!r}, which the rollout sets itself; "
                             f"use {OWNED_CONTINUOUS_KEYS[key]}.")
        if key not in fields:
            raise ValueError(f"transformers_continuous_batching_config key {key!r} is not a transformers "
                             f"ContinuousBatchingConfig field (e.g. page_size, num_blocks, max_batch_tokens).")
