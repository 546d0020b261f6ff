"""Which sampler a run uses when ``generation_backend`` is unset: the device's measured default, unless that default
cannot serve the run (a knob it does not honour, the model, several processes), and then ``generate``.

The decision is made once, at fit start (``Sampling.backend``), and said in the fit-start line; the probe then
measures the chosen backend on the user's model class (``adaptations.check_layout``).
"""

from __future__ import annotations

from typing import Any

from lightalign.modules.generation.samplers import get_sampler, refuse_knobs, several_processes
from lightalign.modules.training.device_tuning import tuned

def default_backend(device_type: str) -> str:
    """The default when ``generation_backend`` is unset: measured per device type (``tuned``'s
    ``generation_backend`` entry: ``compact`` on the project's CPU, measured on the reasoning workload,
    docs/performance.md); ``generate`` where nothing was measured."""
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
