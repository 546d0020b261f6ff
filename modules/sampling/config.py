"""What a rollout samples: the sampling knobs (TRL's names) in one object, checked once.

``SamplingConfig`` holds the knobs every sampling method shares (``SamplingModule``); ``check`` validates them together
with the asked backend at construction, before any model loads (each refusal names the knob and what to use instead),
and ``sampling_kwargs`` is what every sampler's ``sample`` receives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lightalign.knobs import KnobGroup, knob

from lightalign.modules.sampling.samplers import get_sampler, refuse_knobs

# generate() arguments the rollout sets itself: a generation_kwargs entry for one of them is refused, naming the knob.
OWNED_GENERATION_KEYS = {
    "max_new_tokens": "max_completion_length", "max_length": "max_completion_length",
    "num_return_sequences": "num_generations", "temperature": "temperature (the loss divides the logits by it too)",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
    "cache_implementation": "cache_implementation", "do_sample": "nothing: the rollout always samples",
    "num_beams": "nothing: online RL trains on samples of the policy, beam search is not one",
    "eos_token_id": "the model's generation config or the tokenizer", "pad_token_id": "the tokenizer",
    "use_cache": "nothing (always on)", "past_key_values": "share_prefill", "cache": "share_prefill",
    "return_dict_in_generate": "nothing: the rollout reads the generated ids",
}


@dataclass(frozen=True)
class SamplingKnobs(KnobGroup):
    """The knobs every sampling method shares (TRL's names); a method states its own defaults of
    ``max_completion_length`` and ``temperature`` (``takes_knobs(defaults=...)``)."""

    group = "sampling"
    max_completion_length: int = knob(256, "generated tokens at most.")
    temperature: float = knob(1.0, "sampling temperature; the training forward divides the logits by it too, so the "
                                   "loss sees the distribution the completions were sampled from.")
    top_p: float = knob(1.0, "nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p`` "
                             "(1.0: off).")
    top_k: int | None = knob(None, "keep the ``top_k`` most likely tokens (None: off).")
    min_p: float | None = knob(None, "keep tokens whose probability is at least ``min_p`` times the most likely "
                                     "one's (None: off).")
    repetition_penalty: float = knob(1.0, "``generate``'s penalty on tokens already in the sequence (1.0: off).")
    generation_kwargs: dict[str, Any] | None = knob(
        None, "more ``generate`` arguments (``GenerationConfig`` fields such as ``suppress_tokens``, "
              "``no_repeat_ngram_size``); the ones the sampling sets itself (``max_new_tokens``, "
              "``num_return_sequences``, ``temperature``, ``top_p`` ...) are refused naming the knob to use. (TRL lets "
              "them override its knobs.)")
    generation_backend: Literal["generate", "continuous", "static", "compact"] | None = knob(
        None, "the sampler (``SAMPLERS``): ``generate`` (``model.generate``; any knob), ``continuous`` (transformers' "
              "continuous batching, paged KV cache: finished completions leave the batch; refuses "
              "``repetition_penalty``, ``generation_kwargs`` and online RL's ``cache_implementation``), ``static`` "
              "(static KV cache, compiled decode step) or ``compact`` (lightalign's loop: finished completions leave "
              "the batch; refuses ``generation_kwargs``, ``cache_implementation``; one process). Unset: ``compact`` on "
              "a CPU (measured fastest there, docs/performance.md), ``generate`` elsewhere (GPUs not measured), and "
              "``generate`` whenever ``compact`` cannot serve: a knob only ``generate`` honours, several processes, a "
              "model without a plain KV cache, or greedy tokens that differ from ``generate``'s on the model's probe "
              "(``adaptations.check_layout``). Decided at fit start for each model that samples (the policy; a "
              "``seq_kd`` teacher separately), and the fit-start line says which and why. An asked backend that the "
              "probe measures not exact is refused.")

    def check(self) -> None:
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {self.max_completion_length}.")
        ranges = [(self.temperature > 0, f"temperature must be > 0 (the rollout always samples; the loss divides the "
                                         f"logits by it), got {self.temperature}."),
                  (0 < self.top_p <= 1, f"top_p must be in (0, 1] (1.0: off), got {self.top_p}."),
                  (self.top_k is None or self.top_k >= 0, f"top_k must be >= 0 or null (off), got {self.top_k}."),
                  (self.min_p is None or 0 <= self.min_p <= 1, f"min_p must be in [0, 1] or null (off), got "
                                                               f"{self.min_p}."),
                  (self.repetition_penalty > 0, f"repetition_penalty must be > 0 (1.0: off), got "
                                                f"{self.repetition_penalty}.")]
        for ok, message in ranges:
            if not ok:
                raise ValueError(message)
        check_generation_kwargs(self.generation_kwargs)
        if self.generation_backend is not None:
            get_sampler(self.generation_backend)  # unknown: refused naming the registered ones


@dataclass(frozen=True)
class RolloutSamplingKnobs(KnobGroup):
    """Online RL's prefill and KV-cache knobs (beyond ``SamplingKnobs``)."""

    group = "rollout_sampling"
    cache_implementation: str | None = knob(None, "``generate``'s KV-cache implementation (e.g. ``static``); needs "
                                                  "``share_prefill: false`` and the ``generate`` backend.")
    use_transformers_continuous_batching: bool = knob(False, "TRL's name for ``generation_backend: continuous``.")
    transformers_continuous_batching_config: dict[str, Any] | None = knob(
        None, "``ContinuousBatchingConfig`` fields for ``continuous`` (e.g. ``page_size``, ``num_blocks``; by default "
              "the paged cache is sized from the rollout).")
    share_prefill: bool = knob(True, "compute each prompt's prefill once and copy its KV cache to the "
                                     "``num_generations`` completions (same completions as plain ``generate``; refused "
                                     "at fit start on a model where the probe measures it not exact).")

    def check(self) -> None:
        if self.cache_implementation is not None:
            from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

            if self.cache_implementation not in ALL_CACHE_IMPLEMENTATIONS:
                raise ValueError(f"cache_implementation={self.cache_implementation!r} is unknown; transformers knows "
                                 f"{list(ALL_CACHE_IMPLEMENTATIONS)}.")


@dataclass(frozen=True)
class SamplingConfig:
    """What a rollout samples: the sampling knobs of a method's groups, with the backend they ask for, checked
    together (``from_groups``)."""

    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] | None = None
    cache_implementation: str | None = None
    share_prefill: bool = True
    backend: str | None = None  # asked (None: the device's measured default, decided at fit start)
    continuous_config: dict[str, Any] | None = None

    @classmethod
    def from_groups(cls, sampling: SamplingKnobs, rollout: RolloutSamplingKnobs | None = None) -> "SamplingConfig":
        """From a method's ``SamplingKnobs`` (and online RL's ``RolloutSamplingKnobs``; without them: no prefill
        sharing, no cache or continuous-batching settings), with the checks that combine them."""
        backend = resolve_backend(sampling.generation_backend,
                                  rollout.use_transformers_continuous_batching if rollout else False)
        config = cls(max_completion_length=sampling.max_completion_length, temperature=sampling.temperature,
                     top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p,
                     repetition_penalty=sampling.repetition_penalty, generation_kwargs=sampling.generation_kwargs,
                     cache_implementation=rollout.cache_implementation if rollout else None,
                     share_prefill=rollout.share_prefill if rollout else False, backend=backend,
                     continuous_config=rollout.transformers_continuous_batching_config if rollout else None)
        config.check_combinations()
        return config

    @classmethod
    def from_knobs(cls, **knobs: Any) -> "SamplingConfig":
        """From knob names (both groups' names), checked: the groups, then their combinations."""
        rollout_names = set(RolloutSamplingKnobs.knob_names())
        rollout = {k: v for k, v in knobs.items() if k in rollout_names}
        sampling = SamplingKnobs(**{k: v for k, v in knobs.items() if k not in rollout_names})
        return cls.from_groups(sampling, RolloutSamplingKnobs(**rollout) if rollout else None)

    def knobs(self) -> dict[str, Any]:
        """What a sampler's ``refusal`` reads."""
        return dict(repetition_penalty=self.repetition_penalty, generation_kwargs=self.generation_kwargs,
                    cache_implementation=self.cache_implementation, continuous_config=self.continuous_config)

    def sampling_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``Sampler.sample`` beyond prompts, EOS and padding (the same for every sampler:
        a knob one cannot honour was refused at construction, or stepped the default back to ``generate``)."""
        extra = {} if self.cache_implementation is None else {"cache_implementation": self.cache_implementation}
        return dict(share_prefill=self.share_prefill, continuous_config=self.continuous_config,
                    max_new_tokens=self.max_completion_length, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k or 0, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                    **(self.generation_kwargs or {}), **extra)

    def check_combinations(self) -> None:
        """The checks across the sampling knobs and the asked backend (each knob's own range: its group)."""
        if self.backend is not None:  # the asked backend's refusal first: it names the knob to drop
            refuse_knobs(get_sampler(self.backend), **self.knobs())
        if self.cache_implementation is not None and self.share_prefill:
            raise ValueError(f"cache_implementation={self.cache_implementation!r} needs share_prefill: false "
                             "(share_prefill hands generate a DynamicCache holding the shared prompt prefill).")
        if self.backend is None and self.continuous_config is not None:
            # the default may be any backend: only the continuous config is checked here; a knob the default cannot
            # honour makes the default step back to generate at fit start (choice.effective_backend)
            raise ValueError("transformers_continuous_batching_config is set but the generation backend is 'the "
                             "default'; set generation_backend: continuous (or "
                             "use_transformers_continuous_batching: true), or drop the config.")


def resolve_backend(generation_backend: str | None, use_transformers_continuous_batching: bool) -> str | None:
    """The backend the knobs ask for (``None``: the device's default, decided at fit start)."""
    check_backend_knobs(generation_backend, use_transformers_continuous_batching)
    return "continuous" if use_transformers_continuous_batching else generation_backend


def check_backend_knobs(generation_backend: str | None, use_transformers_continuous_batching: bool) -> None:
    """TRL's ``use_transformers_continuous_batching`` asks for the ``continuous`` backend: any other asked backend
    beside it is a contradiction."""
    if use_transformers_continuous_batching and generation_backend not in (None, "continuous"):
        raise ValueError(f"use_transformers_continuous_batching=True asks for generation_backend 'continuous' but "
                         f"generation_backend is {generation_backend!r}; set only one of them.")


def check_generation_kwargs(generation_kwargs: dict[str, Any] | None) -> None:
    """``generation_kwargs``: ``GenerationConfig`` fields the rollout does not set itself."""
    if generation_kwargs is None:
        return
    if not isinstance(generation_kwargs, dict):
        raise ValueError(f"generation_kwargs must be a mapping of generate() arguments, got "
                         f"{type(generation_kwargs).__name__}.")
    from transformers import GenerationConfig

    defaults = GenerationConfig()
    for key in generation_kwargs:
        if key in OWNED_GENERATION_KEYS:
            raise ValueError(f"generation_kwargs sets {key!r}, which the rollout sets itself; use "
                             f"{OWNED_GENERATION_KEYS[key]} instead.")
        if not hasattr(defaults, key):
            raise ValueError(f"generation_kwargs key {key!r} is not a transformers GenerationConfig field "
                             "(e.g. suppress_tokens, no_repeat_ngram_size, bad_words_ids, min_new_tokens).")
