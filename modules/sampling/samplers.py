"""The sampler interface and its registry: every backend that samples rollouts, behind one call.

A sampler turns left-padded prompts into ``num_generations`` completions per prompt (rows grouped by prompt; what
follows a completion's first EOS is not defined) sampled from exactly the distribution the sampling knobs describe,
with the policy's current weights, and optionally the sampler's log-prob of each token. Each declares what it
cannot honour (``refusal``: a knob, or the model), and the rollout refuses that combination at setup naming the
backend, the knob and a backend that serves it. A sampler error is an error: nothing swaps one backend for another
when the first raises.

- ``generate``: ``model.generate`` on a ``DynamicCache`` holding each prompt's prefill once (``share_prefill``);
  every row is decoded until the longest completion ends. Any ``generate`` knob.
- ``continuous``: transformers' continuous batching (``continuous_batching_groups``): a finished completion leaves the
  batch; the group's completions fork from one prefill. Temperature, top_p, top_k, min_p only; one process.
- ``static``: ``generate`` on a static KV cache with the decode step compiled (``static_generate_kwargs``); the prompt
  prefill runs on every copy.
- ``compact``: lightalign's loop on a ``DynamicCache`` with the shared prefill; a completion that emits EOS leaves
  the batch (``compact_groups``). Temperature, top_k, top_p, min_p, repetition_penalty; one process.
- ``vllm``: a vLLM engine on a GPU (``VLLMSampler``: built by the ``VLLMRollouts`` callback, which owns the engine;
  not in this registry).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from lightalign.modules.sampling.generate import SAMPLING_KNOBS

BASIC_KNOBS = tuple(k for k in SAMPLING_KNOBS if k != "repetition_penalty")  # what continuous batching applies


class Samples(NamedTuple):
    """What every sampler returns: the generated tokens ``[P * G, new]`` (rows grouped by prompt; what follows a
    completion's first EOS is not defined), the sampler's log-prob of each token (with ``return_logprobs``, else
    None), and each row's length when a completion can end without EOS before the longest one (vLLM stopping at its
    context length; else None)."""

    ids: torch.Tensor
    logps: torch.Tensor | None = None
    lengths: torch.Tensor | None = None


class Sampler:
    """One backend. ``sample`` has the same signature on every backend."""

    name = ""
    one_process = False  # True: refused when several processes train (its rows end at different steps per rank)

    def refusal(self, *, repetition_penalty: float = 1.0, generation_kwargs: dict[str, Any] | None = None,
                cache_implementation: str | None = None, continuous_config: dict[str, Any] | None = None
                ) -> tuple[str, str] | None:
        """``(knob, why)`` for the first knob this backend cannot honour exactly; None when it serves them all."""
        if continuous_config is not None:
            return "transformers_continuous_batching_config", "it configures the continuous backend only"
        return None

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise ``ValueError`` when this backend cannot sample from ``model`` at all."""

    def sample(self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               num_generations: int, *, eos: list[int], pad_token_id: int, max_new_tokens: int,
               share_prefill: bool = True, continuous_config: dict[str, Any] | None = None,
               return_logprobs: bool = False, **sampling: Any) -> Samples:
        """``num_generations`` completions per prompt of the left-padded ``prompt_ids``."""
        raise NotImplementedError


class GenerateSampler(Sampler):
    name = "generate"

    def sample(self, model, prompt_ids, prompt_mask, num_generations, *, eos, pad_token_id, max_new_tokens,
               share_prefill=True, continuous_config=None, return_logprobs=False, **sampling):
        from lightalign.modules.sampling.generate import generate_groups
        from lightalign.strategies.sharding import generation_context

        prompt_inputs = sampling.pop("prompt_inputs", None)  # image prompts' inputs (sample_groups), repeated
        with generation_context(model) as extra:  # full parameters under FSDP2 / ZeRO-3, released after
            out = generate_groups(model, prompt_ids, prompt_mask, num_generations, share_prefill=share_prefill,
                                  return_logprobs=return_logprobs, prompt_inputs=prompt_inputs, **extra,
                                  do_sample=True, eos_token_id=eos,
                                  pad_token_id=pad_token_id, use_cache=True, max_new_tokens=max_new_tokens,
                                  **sampling)
        sequences, logps = out if return_logprobs else (out, None)
        return Samples(sequences[:, prompt_ids.shape[1]:], logps)


class StaticSampler(GenerateSampler):
    name = "static"

    def refusal(self, *, cache_implementation=None, **knobs):
        if cache_implementation is not None:
            return "cache_implementation", "it sets the cache itself (a static KV cache)"
        return super().refusal(**knobs)

    def sample(self, model, prompt_ids, prompt_mask, num_generations, *, eos, pad_token_id, max_new_tokens,
               share_prefill=True, continuous_config=None, return_logprobs=False, **sampling):
        from lightalign.modules.sampling.static import bucket_prompts, static_generate_kwargs

        prompt_ids, prompt_mask = bucket_prompts(prompt_ids, prompt_mask, pad_token_id)
        return super().sample(model, prompt_ids, prompt_mask, num_generations, eos=eos, pad_token_id=pad_token_id,
                              max_new_tokens=max_new_tokens, share_prefill=False, return_logprobs=return_logprobs,
                              **{**sampling, **static_generate_kwargs()})


class CompactSampler(Sampler):
    name = "compact"
    one_process = True

    def refusal(self, *, generation_kwargs=None, cache_implementation=None, **knobs):
        if generation_kwargs:
            return "generation_kwargs", f"it applies only {', '.join(BASIC_KNOBS)}, repetition_penalty"
        if cache_implementation is not None:
            return "cache_implementation", "it samples on its own DynamicCache"
        return super().refusal(**knobs)

    def check_model(self, model):
        from lightalign.modules.sampling.compact import check_compact_model

        check_compact_model(model)

    def sample(self, model, prompt_ids, prompt_mask, num_generations, *, eos, pad_token_id, max_new_tokens,
               share_prefill=True, continuous_config=None, return_logprobs=False, **sampling):
        from lightalign.modules.sampling.compact import compact_groups
        from lightalign.strategies.sharding import generation_context

        with generation_context(model):  # full parameters under FSDP2 / ZeRO-3 (one process), released after
            return Samples(*compact_groups(model, prompt_ids, prompt_mask, num_generations, eos_token_ids=eos,
                                  pad_token_id=pad_token_id, max_new_tokens=max_new_tokens,
                                  share_prefill=share_prefill, return_logprobs=return_logprobs, **sampling))


class ContinuousSampler(Sampler):
    name = "continuous"
    one_process = True  # transformers' continuous batching seeds and shards across the process group itself

    def refusal(self, *, repetition_penalty=1.0, generation_kwargs=None, cache_implementation=None,
                continuous_config=None):
        if repetition_penalty != 1.0:
            return "repetition_penalty", "transformers' continuous batching drops its logits processor"
        if generation_kwargs:
            return "generation_kwargs", f"continuous batching applies only {'/'.join(BASIC_KNOBS)}"
        if cache_implementation is not None:
            return "cache_implementation", "continuous batching uses its own paged cache"
        if continuous_config is not None:
            from lightalign.modules.sampling.continuous import check_continuous_config

            check_continuous_config(continuous_config)
        return None

    def sample(self, model, prompt_ids, prompt_mask, num_generations, *, eos, pad_token_id, max_new_tokens,
               share_prefill=True, continuous_config=None, return_logprobs=False, **sampling):
        from lightalign.modules.sampling.continuous import continuous_batching_groups

        unknown = set(sampling) - set(SAMPLING_KNOBS)
        if sampling.get("repetition_penalty", 1.0) != 1.0 or unknown:
            raise ValueError(f"generation_backend 'continuous' applies only {'/'.join(BASIC_KNOBS)}; got "
                             f"{sorted(sampling)}: use generation_backend: generate.")
        return Samples(*continuous_batching_groups(
            model, prompt_ids, prompt_mask, num_generations, eos_token_ids=eos, pad_token_id=pad_token_id,
            max_new_tokens=max_new_tokens, temperature=sampling.get("temperature", 1.0),
            top_p=sampling.get("top_p", 1.0), top_k=sampling.get("top_k", 0), min_p=sampling.get("min_p"),
            config=continuous_config, return_logprobs=return_logprobs))


SAMPLERS: dict[str, Callable[[], Sampler]] = {
    cls.name: cls for cls in (GenerateSampler, ContinuousSampler, StaticSampler, CompactSampler)}
GENERATION_BACKENDS = tuple(SAMPLERS)


def get_sampler(name: str) -> Sampler:
    """The registered sampler ``name`` (``generate``, ``continuous``, ``static``, ``compact``)."""
    if name not in SAMPLERS:
        raise ValueError(f"generation_backend={name!r} is unknown; use one of {list(SAMPLERS)} or leave it unset for "
                         "the measured default.")
    return SAMPLERS[name]()


def several_processes() -> bool:
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def check_processes(sampler: Sampler) -> None:
    """Refuse a one-process sampler when several processes train."""
    if sampler.one_process and several_processes():
        raise ValueError(f"generation_backend {sampler.name!r} is not supported with several processes here (its "
                         "rows end after different numbers of forwards on each rank); use generation_backend: "
                         "generate.")


def refuse_knobs(sampler: Sampler, **knobs: Any) -> None:
    """Raise naming the backend, the knob and a backend that serves it, when ``sampler`` cannot honour a knob."""
    refused = sampler.refusal(**knobs)
    if refused is not None:
        knob, why = refused
        if knob == "transformers_continuous_batching_config":
            raise ValueError(f"transformers_continuous_batching_config is set but the generation backend is "
                             f"{sampler.name!r} ({why}); set generation_backend: continuous (or "
                             "use_transformers_continuous_batching: true), or drop the config.")
        raise ValueError(f"generation_backend {sampler.name!r} cannot honour {knob} ({why}); use generation_backend: "
                         f"generate for it, or unset {knob}.")


def sample_groups(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int,
                  *, backend: str | Sampler, eos: list[int], pad_token_id: int, max_new_tokens: int,
                  share_prefill: bool = True, continuous_config: dict[str, Any] | None = None,
                  return_logprobs: bool = False, prompt_inputs: dict[str, Any] | None = None,
                  **sampling: Any) -> Samples:
    """``backend``'s ``sample`` (a registered name or a ``Sampler``), refused first when several processes train
    and the backend runs in one only. ``prompt_inputs``: the image inputs of the prompts repeated
    ``num_generations`` times (``repeated_prompt_inputs``), which only ``generate`` takes (``refuse_images``)."""
    sampler = get_sampler(backend) if isinstance(backend, str) else backend
    check_processes(sampler)
    if prompt_inputs:
        refuse_images(sampler.name, None)
        sampling["prompt_inputs"] = prompt_inputs
    return sampler.sample(model, prompt_ids, prompt_mask, num_generations, eos=eos, pad_token_id=pad_token_id,
                          max_new_tokens=max_new_tokens, share_prefill=share_prefill,
                          continuous_config=continuous_config, return_logprobs=return_logprobs, **sampling)


IMAGE_BACKENDS = ("generate",)  # the backends that sample image prompts (measured: tests/vision)


def refuse_images(backend: str, knob: str | None) -> None:
    """Refuse sampling prompts with images on ``backend`` unless it is one that takes them (``IMAGE_BACKENDS``):
    the other backends run the prompt through the model without its images. ``knob``: the setting that chose it."""
    if backend in IMAGE_BACKENDS:
        return
    chosen = f" ({knob})" if knob else ""
    raise ValueError(f"The prompts have images, and the generation backend '{backend}'{chosen} samples without "
                     "them (only 'generate' passes a prompt's images to the model): set generation_backend: "
                     "generate (and use_vllm / use_transformers_continuous_batching: false).")
