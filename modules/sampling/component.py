"""``Sampling``: how a method samples completions, from its ``SamplingConfig``.

It chooses the sampler of each model that samples (the policy; a teacher that writes sequences) once per fit
(``choose_sampler``: measured on the model, refused or stepped back to ``generate`` at fit start, with the
fit-start note saying which and why), samples with it, and gives validation its own seeded random stream. With
``use_vllm`` the vLLM callback (``VLLMRollouts``) hands it an engine's sampler per model instead
(``use_engine``), for the fit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightalign.modules.sampling.config import SamplingConfig

VALIDATION_SEED_STRIDE = 100_003  # validation batch i at optimizer step s samples with seed s * stride + i


class Sampling:
    """The sampling knobs (``config``) and the samplers chosen for them this fit, per model (``who``)."""

    def __init__(self, config: SamplingConfig) -> None:
        self.config = config
        self.chosen: dict[str, tuple[str, str]] = {}  # who -> (sampler, fit-start note)
        self.engines: dict[str, Any] = {}  # who -> an engine's Sampler (vLLM), for this fit
        self.images = False  # the prompts have images: only generate samples them (choose_sampler)

    def sampling_kwargs(self) -> dict[str, Any]:
        return self.config.sampling_kwargs()

    def reset(self) -> None:
        """Forget the choices: decided again at the next fit start (the models may have changed); the engines
        handed in for this fit stay."""
        self.chosen = {who: choice for who, choice in self.chosen.items() if who in self.engines}

    def use_engine(self, who: str, sampler: Any, note: str) -> None:
        """``who`` samples through ``sampler`` (an engine's ``Sampler``) until ``release``; ``note``: its fit-start
        note."""
        self.engines[who] = sampler
        self.chosen[who] = (sampler.name, note)

    def release(self) -> None:
        """Drop the engines' samplers (fit end): the transformers samplers are chosen again at the next fit."""
        for who in self.engines:
            self.chosen.pop(who, None)
        self.engines = {}

    def backend(self, model: torch.nn.Module, who: str = "policy", largest_group: int = 1) -> str:
        """The sampler of ``who``'s completions, decided on ``model`` the first time this fit (``choose_sampler``);
        ``largest_group``: the most completions per prompt it samples."""
        from lightalign.modules.sampling.choice import choose_sampler

        if who not in self.chosen:
            self.chosen[who] = choose_sampler(model, self.config, largest_group, images=self.images)
        return self.chosen[who][0]

    def sampler(self, model: torch.nn.Module, who: str = "policy", largest_group: int = 1) -> Any:
        """What ``sample_completions`` samples ``who``'s completions with: its engine's sampler, or the name of the
        transformers sampler chosen on ``model`` (``backend``)."""
        return self.engines[who] if who in self.engines else self.backend(model, who, largest_group)

    def note(self, who: str = "policy") -> str:
        """The fit-start note of ``who``'s sampler ("" before it is chosen)."""
        return self.chosen[who][1] if who in self.chosen else ""

    @torch.no_grad()
    def sample(self, model: torch.nn.Module, tokenizer: Any, batch: dict[str, Any], num_generations: int,
               who: str = "policy", largest_group: int | None = None, **extra: Any) -> dict[str, Any]:
        """``num_generations`` completions per prompt of ``batch`` from ``model`` on ``who``'s sampler."""
        from lightalign.modules.sampling.completions import sample_completions

        backend = self.sampler(model, who, largest_group or num_generations)
        return sample_completions(model, tokenizer, batch, num_generations, backend=backend, **extra,
                                  **self.sampling_kwargs())

    @staticmethod
    @contextmanager
    def validation_stream(module: Any, batch_idx: int) -> Iterator[None]:
        """Validation's own seeded random stream (torch's, and CUDA's on a GPU): validating draws nothing from the
        training stream, and a resumed run validates on what the uninterrupted run sampled."""
        with torch.random.fork_rng(devices=[module.device] if module.device.type == "cuda" else []):
            torch.manual_seed(module.global_step * VALIDATION_SEED_STRIDE + batch_idx)
            yield
