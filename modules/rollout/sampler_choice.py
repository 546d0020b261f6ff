"""Which sampler a run samples with, decided once at fit start and measured on the user's model class.

The asked backend, or the device's default (``effective_backend``); a backend other than ``generate`` is
measured on a probe of the policy (``adaptations.check_layout``: greedy completions equal ``generate`` on each
prompt alone). An asked backend, or the shared prefill, that is not exact is refused naming the knob; a default
that is not exact steps back to ``generate``, and the fit-start line says so and why.
"""

from __future__ import annotations

import torch

from lightalign.modules.generation.backends import effective_backend
from lightalign.modules.generation.config import SamplingConfig
from lightalign.modules.generation.samplers import check_processes, get_sampler


def choose_sampler(model: torch.nn.Module, sampling: SamplingConfig, largest_group: int = 2) -> tuple[str, str]:
    """(the sampler's name, the fit-start note saying how it was chosen). ``largest_group``: the most completions
    per prompt the run samples (with one, no prefill is shared and ``share_prefill`` is not measured)."""
    from lightalign.modules.adaptations import describe_decision
    from lightalign.modules.adaptations.support import LayoutRefused, check_layout

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
