"""Which engine samples a rollout: the ``generation_backend`` knob, its default, and the knobs each backend refuses.

Every backend returns the same completions contract (``generation.sample_completions``): ``num_generations`` rows per
prompt, grouped by prompt, sampled from exactly the distribution the sampling knobs describe, with the policy's
current weights.

- ``generate``: ``model.generate`` on a ``DynamicCache`` holding each prompt's prefill once (``share_prefill``);
  every row of the batch is decoded until the longest completion ends. The fallback; any ``generate`` knob.
- ``continuous``: transformers' continuous batching (``generate_batch``, paged KV cache): a finished completion leaves
  the batch, and the group's completions fork from one prefill. TRL 1.16 names it
  ``use_transformers_continuous_batching`` (accepted here too); ``transformers_continuous_batching_config`` takes
  ``ContinuousBatchingConfig`` fields. Its cache is sized from the rollout (not from the machine's free memory).
- ``static``: ``generate`` on a static KV cache with the decode step compiled by ``torch.compile``; the prompt prefill
  runs on every copy (``share_prefill`` does not apply); the first rollout pays the compilation.
- ``compact``: lightalign's own sampling loop on a ``DynamicCache`` with the shared prefill; a completion that emits
  EOS leaves the batch (its rows of the cache, mask and positions are gathered out), so no step decodes finished
  rows (``generation_compact``); on the CPU its linears run on oneDNN-prepacked weights. Sampling knobs:
  temperature, top_k, top_p, min_p, repetition_penalty (transformers' own processors); one process. The CPU
  default.
"""

from __future__ import annotations

from typing import Any

GENERATION_BACKENDS = ("generate", "continuous", "static", "compact")

# The default when generation_backend is unset, by device type (missing: generate). On the project's 2-core CPU,
# bench/grpo.py --shape reasoning (docs/performance.md, 2026-11-24) measured compact ahead of generate and continuous
# on the whole GRPO step; GPUs keep generate until measured there. A model compact cannot sample from (an
# encoder-decoder, a recurrent state, a hybrid cache), a knob only generate honours, or several processes make the
# default generate (effective_backend, GRPOModule.generate).
DEFAULT_BACKEND: dict[str, str] = {"cpu": "compact"}

# ContinuousBatchingConfig fields the rollout sets itself, with what to use instead.
OWNED_CONTINUOUS_KEYS = {
    "return_logprobs": "nothing: the rollout asks for the sampler's log-probs when it needs them",
    "seed": "the run's seed (seed_everything): a fixed seed would sample the same completions in every rollout",
}


def resolve_backend(generation_backend: str | None, use_transformers_continuous_batching: bool) -> str | None:
    """The backend the knobs ask for (``None``: the device's default, decided at generation time)."""
    if generation_backend is not None and generation_backend not in GENERATION_BACKENDS:
        raise ValueError(f"generation_backend={generation_backend!r} is unknown; use one of {list(GENERATION_BACKENDS)} "
                         "or leave it unset for the measured default.")
    if use_transformers_continuous_batching:
        if generation_backend not in (None, "continuous"):
            raise ValueError(f"use_transformers_continuous_batching=True asks for generation_backend 'continuous' but "
                             f"generation_backend is {generation_backend!r}; set only one of them.")
        return "continuous"
    return generation_backend


def default_backend(device_type: str) -> str:
    return DEFAULT_BACKEND.get(device_type, "generate")


def check_backend_knobs(backend: str | None, *, transformers_continuous_batching_config: dict[str, Any] | None,
                        repetition_penalty: float, generation_kwargs: dict[str, Any] | None,
                        cache_implementation: str | None) -> None:
    """Refuse, at construction, a knob the chosen backend cannot honour exactly (naming backend, knob, alternative).
    With the backend unset the default may be any backend, so only knobs every backend honours are checked there:
    a knob only ``generate`` honours then pins the default to ``generate`` (``effective_backend``)."""
    config = transformers_continuous_batching_config
    if config is not None:
        if backend != "continuous":
            raise ValueError("transformers_continuous_batching_config is set but the generation backend is "
                             f"{backend or 'the default'!r}; set generation_backend: continuous (or "
                             "use_transformers_continuous_batching: true), or drop the config.")
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
    if backend == "continuous":
        refused = []
        if repetition_penalty != 1.0:
            refused.append(("repetition_penalty", "transformers' continuous batching drops its logits processor"))
        if generation_kwargs:
            refused.append(("generation_kwargs", "continuous batching applies only temperature/top_k/top_p/min_p"))
        if cache_implementation is not None:
            refused.append(("cache_implementation", "continuous batching uses its own paged cache"))
        if refused:
            knob, why = refused[0]
            raise ValueError(f"generation_backend 'continuous' cannot honour {knob} ({why}); use generation_backend: "
                             f"generate for it, or unset {knob}.")
    if backend == "compact" and (generation_kwargs or cache_implementation is not None):
        knob = "generation_kwargs" if generation_kwargs else "cache_implementation"
        raise ValueError(f"generation_backend 'compact' cannot honour {knob} (it applies only temperature/top_k/top_p/"
                         f"min_p/repetition_penalty on its own DynamicCache); use generation_backend: generate for it, "
                         f"or unset {knob}.")
    if backend == "static" and cache_implementation is not None:
        raise ValueError("generation_backend 'static' sets the cache itself (a static KV cache); unset "
                         "cache_implementation, or use generation_backend: generate with cache_implementation.")


def several_processes() -> bool:
    import torch

    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def effective_backend(backend: str | None, model: Any, *, repetition_penalty: float,
                      generation_kwargs: dict[str, Any] | None, cache_implementation: str | None
                      ) -> tuple[str, str | None]:
    """The backend a rollout of ``model`` runs on, and why the device's default was not taken (None when it was, or
    when a backend was asked): the asked one, else the device's default, unless that default would refuse a knob
    (``check_backend_knobs``) or the model (``compact``), or several processes train: then ``generate``."""
    if backend is not None:
        return backend, None
    chosen = default_backend(model.device.type)
    if chosen == "generate":
        return "generate", None
    if several_processes():
        return "generate", f"the default {chosen} runs in one process only"
    try:
        check_backend_knobs(chosen, transformers_continuous_batching_config=None,
                            repetition_penalty=repetition_penalty, generation_kwargs=generation_kwargs,
                            cache_implementation=cache_implementation)
        if chosen == "compact":
            from lightalign.modules.generation.compact import check_compact_model

            check_compact_model(model)
    except ValueError as refused:  # the default's own refusal, said in the fit-start line
        return "generate", str(refused)
    return chosen, None
