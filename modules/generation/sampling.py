"""Sampling a group of completions per prompt with the prompt's prefill computed once.

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
                    **generate_kwargs: Any):
    """``num_generations`` completions per prompt, rows grouped by prompt: ``[P * G, prompt_len + new]``.

    With ``share_prefill`` (and prompts of at least two tokens) the prompt prefill runs once per prompt;
    otherwise this is ``model.generate(num_return_sequences=num_generations)``. With ``return_logprobs`` also the
    sampler's log-prob of each new token ``[P * G, new]`` (``generate``'s processed scores: the distribution sampled
    from), as ``(sequences, logprobs)``."""
    if return_logprobs:
        generate_kwargs.update(output_scores=True, return_dict_in_generate=True)
    if not share_prefill or num_generations == 1 or prompt_ids.shape[1] < 2:
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                             num_return_sequences=num_generations, **generate_kwargs)
    else:
        cache = prefill_shared_cache(model, prompt_ids, prompt_mask, num_generations)
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


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Every id that ends a completion: the generation config's and the tokenizer's EOS."""
    ids = model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else ([] if ids is None else [ids])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def sample_groups(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int,
                  *, backend: str, eos: list[int], pad_token_id: int, max_new_tokens: int, share_prefill: bool = True,
                  continuous_config: dict[str, Any] | None = None, return_logprobs: bool = False,
                  **sampling: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The generated tokens ``[P * G, new]`` of ``backend`` (rows grouped by prompt; what follows a completion's
    first EOS is not defined) and, with ``return_logprobs``, the sampler's log-prob of each ``[P * G, new]``.
    ``sampling``: temperature, top_p, top_k, min_p, repetition_penalty and other ``generate`` arguments."""
    from lightalign.strategies.sharding import generation_context

    if backend == "continuous":
        if sampling.get("repetition_penalty", 1.0) != 1.0 or set(sampling) - {"temperature", "top_p", "top_k",
                                                                                 "min_p", "repetition_penalty"}:
            raise ValueError("generation_backend 'continuous' applies only temperature/top_p/top_k/min_p; got "
                             f"{sorted(sampling)}: use generation_backend: generate.")
        from lightalign.modules.generation.backends import several_processes

        if several_processes():
            raise ValueError("generation_backend 'continuous' is not supported with several processes here "
                             "(transformers' continuous batching seeds and shards across the process group itself); "
                             "use generation_backend: generate.")
        from lightalign.modules.generation.continuous import continuous_batching_groups

        return continuous_batching_groups(
            model, prompt_ids, prompt_mask, num_generations, eos_token_ids=eos, pad_token_id=pad_token_id,
            max_new_tokens=max_new_tokens, temperature=sampling.get("temperature", 1.0),
            top_p=sampling.get("top_p", 1.0), top_k=sampling.get("top_k", 0), min_p=sampling.get("min_p"),
            config=continuous_config, return_logprobs=return_logprobs)
    if backend == "compact":
        from lightalign.modules.generation.backends import several_processes
        from lightalign.modules.generation.compact import compact_groups

        if several_processes():
            raise ValueError("generation_backend 'compact' is not verified with several processes yet (its rows end "
                             "after different numbers of forwards on each rank); use generation_backend: generate.")
        with generation_context(model):  # full parameters under FSDP2 / ZeRO-3 (one process), released after
            return compact_groups(model, prompt_ids, prompt_mask, num_generations, eos_token_ids=eos,
                                  pad_token_id=pad_token_id, max_new_tokens=max_new_tokens, share_prefill=share_prefill,
                                  return_logprobs=return_logprobs, **sampling)
    if backend == "static":
        from lightalign.modules.generation.static import bucket_prompts, static_generate_kwargs

        prompt_ids, prompt_mask = bucket_prompts(prompt_ids, prompt_mask, pad_token_id)
        sampling = {**sampling, **static_generate_kwargs()}
        share_prefill = False
    elif backend != "generate":
        raise ValueError(f"generation_backend={backend!r} is unknown.")
    with generation_context(model) as extra:  # full parameters under FSDP2 / ZeRO-3, released after
        out = generate_groups(model, prompt_ids, prompt_mask, num_generations, share_prefill=share_prefill,
                              return_logprobs=return_logprobs, **extra, do_sample=True, eos_token_id=eos,
                              pad_token_id=pad_token_id, use_cache=True, max_new_tokens=max_new_tokens, **sampling)
    sequences, logps = out if return_logprobs else (out, None)
    return sequences[:, prompt_ids.shape[1]:], logps


def cut_after_eos(completion_ids: torch.Tensor, eos: list[int], pad_token_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Completions cut after their first EOS: ``(ids padded with pad_token_id, mask through EOS, truncated)``."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos, device=completion_ids.device))
    has_eos = is_eos.any(-1)
    first = torch.where(has_eos, is_eos.int().argmax(-1), completion_ids.shape[1])
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    completion_mask = (positions[None, :] <= first[:, None]).long()
    return completion_ids.masked_fill(completion_mask == 0, pad_token_id), completion_mask, ~has_eos


@torch.no_grad()
def sample_completions(model: torch.nn.Module, tokenizer: Any, batch: dict[str, Any], num_generations: int,
                       share_prefill: bool = True, backend: str = "generate",
                       continuous_config: dict[str, Any] | None = None, return_logprobs: bool = False,
                       max_new_tokens: int = 256, **sampling: Any) -> dict[str, Any]:
    """A GRPO rollout: ``num_generations`` sampled completions per prompt of a ``PromptCollator`` batch (eval mode,
    KV cache, then the model's mode is restored), cut after their first EOS, on the generation ``backend``
    (``generation_backends``).

    Returns rows grouped by prompt: ``prompt_ids``/``prompt_mask`` (left-padded), ``completion_ids``/
    ``completion_mask`` (through EOS, padded after), ``truncated`` (no EOS), and for the reward functions
    ``prompts``, ``completions`` (strings, or assistant messages for conversational prompts), ``texts`` and
    ``columns`` (the data's other columns, plus ``completion_ids``). With ``return_logprobs`` also
    ``sampling_logps`` ``[rows, T]``: the log-prob each token had in the distribution it was sampled from
    (0 under the mask's zeros)."""
    eos = eos_token_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    try:
        completion_ids, logps = sample_groups(
            model, batch["prompt_input_ids"], batch["prompt_attention_mask"], num_generations, backend=backend,
            eos=eos, pad_token_id=tokenizer.pad_token_id, max_new_tokens=max_new_tokens, share_prefill=share_prefill,
            continuous_config=continuous_config, return_logprobs=return_logprobs, **sampling)
    finally:
        model.train(was_training)
    completion_ids, completion_mask, truncated = cut_after_eos(completion_ids, eos, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    prompts = [p for p in batch["prompts"] for _ in range(num_generations)]
    completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]
    columns = {k: [v for v in vals for _ in range(num_generations)] for k, vals in batch["columns"].items()}
    columns["completion_ids"] = [ids[m.bool()].tolist() for ids, m in zip(completion_ids, completion_mask)]
    rollout = {
        "prompt_ids": batch["prompt_input_ids"].repeat_interleave(num_generations, 0),
        "prompt_mask": batch["prompt_attention_mask"].repeat_interleave(num_generations, 0),
        "completion_ids": completion_ids, "completion_mask": completion_mask, "truncated": truncated,
        "prompts": prompts, "completions": completions, "texts": texts, "columns": columns,
    }
    if logps is not None:
        rollout["sampling_logps"] = logps * completion_mask
    return rollout


def check_generation_arithmetic(generation_batch_size: int, num_generations: int, steps: int | None) -> None:
    if generation_batch_size % num_generations:
        raise ValueError(
            f"generation_batch_size ({generation_batch_size}) must be divisible by num_generations ({num_generations}): "
            f"{generation_batch_size} = {generation_batch_size // num_generations} x {num_generations} + "
            f"{generation_batch_size % num_generations}. Use a multiple of {num_generations}, e.g. "
            f"{(generation_batch_size // num_generations + 1) * num_generations}."
        )
    if steps and generation_batch_size % steps:
        raise ValueError(
            f"generation_batch_size ({generation_batch_size}) must split evenly into steps_per_generation ({steps}) "
            f"micro-batches: {generation_batch_size} / {steps} is not an integer."
        )


def check_rollout_config(num_generations: int, num_iterations: int, steps_per_generation: int | None,
                         generation_batch_size: int | None, pack_length: int) -> None:
    """GRPO's rollout knobs, checked at construction."""
    if num_generations < 2:
        raise ValueError(f"num_generations must be >= 2 (advantages compare completions of a group), got {num_generations}.")
    if num_iterations < 1:
        raise ValueError(f"num_iterations must be >= 1, got {num_iterations}.")
    if steps_per_generation is not None and steps_per_generation < 1:
        raise ValueError(f"steps_per_generation must be >= 1, got {steps_per_generation}.")
    if generation_batch_size is not None:
        check_generation_arithmetic(generation_batch_size, num_generations, steps_per_generation)
    if pack_length < 1:
        raise ValueError(f"pack_length must be >= 1, got {pack_length}.")


def split_rollout(tensors: dict[str, torch.Tensor], lengths: torch.Tensor, steps: int, num_generations: int,
                  whole_groups: bool) -> list[dict[str, torch.Tensor]]:
    """A rollout's rows, shuffled (the torch RNG), into ``steps`` micro-batches; each also gets ``lengths`` (its
    rows' completion lengths). ``whole_groups`` keeps each prompt's group in one micro-batch (prompt sharing);
    otherwise groups mix across micro-batches, as TRL does."""
    rows = lengths.shape[0]
    device = lengths.device
    if whole_groups:
        g = num_generations
        order = (torch.randperm(rows // g, device=device)[:, None] * g + torch.arange(g, device=device)).flatten()
    else:
        order = torch.randperm(rows, device=device)
    tensors = {k: v[order] for k, v in tensors.items()}
    tensors["lengths"] = lengths[order]
    micro = rows // steps
    return [{k: v[i * micro:(i + 1) * micro] for k, v in tensors.items()} for i in range(steps)]


# generate() arguments GRPOModule sets itself: a generation_kwargs entry for one of them is refused, naming the knob.
OWNED_GENERATION_KEYS = {
    "max_new_tokens": "max_completion_length", "max_length": "max_completion_length",
    "num_return_sequences": "num_generations", "temperature": "temperature (the loss divides the logits by it too)",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
    "cache_implementation": "cache_implementation", "do_sample": "nothing: GRPO always samples",
    "num_beams": "nothing: GRPO trains on samples of the policy, beam search is not one",
    "eos_token_id": "the model's generation config or the tokenizer", "pad_token_id": "the tokenizer",
    "use_cache": "nothing (always on)", "past_key_values": "share_prefill", "cache": "share_prefill",
    "return_dict_in_generate": "nothing: the rollout reads the generated ids",
}


def check_generation_knobs(generation_kwargs: dict[str, Any] | None, cache_implementation: str | None,
                           share_prefill: bool) -> None:
    """``generation_kwargs`` and ``cache_implementation`` of GRPOModule, checked at construction."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

    if generation_kwargs is not None:
        if not isinstance(generation_kwargs, dict):
            raise ValueError(f"generation_kwargs must be a mapping of generate() arguments, got "
                             f"{type(generation_kwargs).__name__}.")
        defaults = GenerationConfig()
        for key in generation_kwargs:
            if key in OWNED_GENERATION_KEYS:
                raise ValueError(f"generation_kwargs sets {key!r}, which GRPOModule sets itself; use "
                                 f"{OWNED_GENERATION_KEYS[key]} instead.")
            if not hasattr(defaults, key):
                raise ValueError(f"generation_kwargs key {key!r} is not a transformers GenerationConfig field "
                                 "(e.g. suppress_tokens, no_repeat_ngram_size, bad_words_ids, min_new_tokens).")
    if cache_implementation is not None:
        if cache_implementation not in ALL_CACHE_IMPLEMENTATIONS:
            raise ValueError(f"cache_implementation={cache_implementation!r} is unknown; transformers knows "
                             f"{list(ALL_CACHE_IMPLEMENTATIONS)}.")
        if share_prefill:
            raise ValueError(f"cache_implementation={cache_implementation!r} needs share_prefill: false (share_prefill "
                             "hands generate a DynamicCache holding the shared prompt prefill).")
