"""What an online method runs with prompts that carry images, refused at setup otherwise.

Measured exact with images (tests/vision): sampling on the ``generate`` backend, each prompt repeated
``num_generations`` times with its images (``generate_groups``), and the log-prob forwards of padded
``[left-padded prompt, completion]`` rows with each row's prompt images (the policy's, the sampling policy's and the
reference's: ``prompt_image_kwargs``), for GRPO, RLOO and online DPO. Everything else that would see the prompts
without their images (another backend, vLLM, a shared prompt prefill, a training layout other than padded rows, a
sampler ahead in another process, tool turns, a method that rebuilds its prompts from text) is refused naming the
knob and what to set (``check_image_prompts``); the backend itself is chosen in ``choose_sampler``.
"""

from __future__ import annotations

from typing import Any

# knob -> (the value that refuses it, what to set instead); read from the module's hyper-parameters when it has them
UNMEASURED_WITH_IMAGES = {
    "use_vllm": (True, "use_vllm: false (the generate backend samples with the images)"),
    "max_staleness": ("> 0", "max_staleness: 0 (sampling in the training process)"),
    "tools": ("set", "no tools (single-turn rollouts)"),
    "environment_factory": ("set", "no environment_factory (single-turn rollouts)"),
}


def check_image_prompts(module: Any) -> None:
    """Refuse, at setup, a method or a knob that is not exact with image prompts (module docstring)."""
    name = type(module).__name__
    if not getattr(module, "takes_images", False):
        raise ValueError(f"{name} does not train on prompts with images (the data's 'images'/'image' column): "
                         "GRPOModule, RLOOModule, OnlineDPOModule and DistillModule do; or drop the image column.")
    hp = module.hparams
    for knob, (value, instead) in UNMEASURED_WITH_IMAGES.items():
        given = hp.get(knob)
        refused = (given is True if value is True else bool(given) and given != 0)
        if refused:
            raise ValueError(f"{name}: {knob}={given!r} is not available with prompts that have images (it would see "
                             f"the prompts without them, or is not measured exact with them); set {instead}.")
