"""Which sampler a run samples with, decided once at fit start (``Sampling.backend``) and measured on the user's
model class.

The asked backend (``generation_backend``), or else the device's measured default (``default_backend``), unless that
default cannot serve the run (a knob it does not honour, the model, several processes: ``effective_backend``), and
then ``generate``. A backend other than ``generate`` is measured on a probe of the policy (``adaptations.check_layout``:
greedy completions equal ``generate`` on each prompt alone). An asked backend, or the shared prefill, that is not
exact is refused naming the knob; a default that is not exact steps back to ``generate``, and the fit-start line says
so and why (``choose_sampler``).
"""

from __future__ import annotations

from typing import Any

import torch

from lightalign.modules.sampling.config import SamplingConfig
from lightalign.modules.sampling.samplers import check_processes, get_sampler, refuse_knobs, several_processes
from lightalign.modules.training.device_tuning import tuned


def default_backend(device_type: str) -> str:
    """The default when ``generation_backend`` is unset: ``tuned``'s ``generation_backend`` entry (``compact``,
    measured on the reasoning workload on the project's CPU, docs/performance.md) where it applies on this machine
    (recorded for its machine key); ``generate`` elsewhere."""
    return tuned("generation_backend", device_type)


def effective_backend(backend: str | None, model: Any, knobs: dict[str, Any]) -> tuple[str, str | None]:
    """The backend a rollout of ``model`` runs on, and why the device's default was not taken (None when it was, or
    when a backend was asked): the asked one, else the device's default, unless that default refuses a knob
    (``Sampler.refusal``) or the model (``Sampler.check_model``), or runs in one process while several train: then
    ``generate``. ``knobs``: ``SamplingConfig.knobs()``."""
    if backend is not None:
        return backend, None
    chosen = default_backend(model.device.type)
    if chosen == "generate":
        return "generate", None
    sampler = get_sampler(chosen)
    if sampler.one_process and several_processes():
        return "generate", f"the default {chosen} runs in one process only"
    try:
        refuse_knobs(sampler, **knobs)
        sampler.check_model(model)
    except ValueError as refused:  # the default's own refusal of a knob or of this model, said in the fit-start line
        return "generate", str(refused)
    return chosen, None


def choose_sampler(model: torch.nn.Module, sampling: SamplingConfig, largest_group: int = 2,
                   images: bool = False) -> tuple[str, str]:
    """(the sampler's name, the fit-start note saying how it was chosen). ``largest_group``: the most completions
    per prompt the run samples (with one, no prefill is shared and ``share_prefill`` is not measured). ``images``:
    the prompts have images, which only ``generate`` samples with (``image_prompt_sampler``)."""
    from lightalign.modules.adaptations import describe_decision
    from lightalign.modules.adaptations.support import LayoutRefused, check_layout

    if images:
        return image_prompt_sampler(sampling, largest_group)
    asked = sampling.backend
    if asked is not None:
        check_processes(get_sampler(asked))  # an asked one-process backend is refused here, before any rollout
    backend, why_not_default = effective_backend(asked, model, sampling.knobs())
    how = f"not the device's default: {why_not_default}" if why_not_default else "asked" if asked else "default"
    if backend != "generate":
        try:
            how += ", " + describe_decision(check_layout(model, backend))
        except LayoutRefused as refused:
            if asked is not None:
                raise
            how, backend = f"the default {backend} is not exact on this model: {refused}", "generate"
    if sampling.share_prefill and backend == "generate" and largest_group > 1:
        check_layout(model, "shared_prefill")  # refused naming model.share_prefill
    return backend, f"generation {backend} ({how})"


def image_prompt_sampler(sampling: SamplingConfig, largest_group: int) -> tuple[str, str]:
    """The sampler of prompts with images: ``generate``, the one backend that passes a prompt's images to the model
    (``IMAGE_BACKENDS``); another asked backend is refused naming its knob, and so is ``share_prefill`` (its
    prefill runs the prompts without their images)."""
    from lightalign.modules.sampling.samplers import refuse_images

    asked = sampling.backend
    if asked is not None:
        refuse_images(asked, "generation_backend" if asked != "continuous"
                      else "generation_backend / use_transformers_continuous_batching")
    if sampling.share_prefill and largest_group > 1:
        raise ValueError("share_prefill=True computes each prompt's prefill without its images; with image prompts "
                         "set share_prefill: false (generate then runs every copy of a prompt with its images).")
    how = "asked" if asked else "the prompts have images: only generate samples with them"
    return "generate", f"generation generate ({how})"
