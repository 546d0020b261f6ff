"""``activation_offloading``: keep the activations saved for backward in (pinned) CPU memory instead of on the
GPU, and bring them back during backward (TRL's ``activation_offloading``; ``torch.autograd.graph.save_on_cpu``).

On a CPU device the activations already live in CPU memory: the knob changes nothing there, and the fit-start line
says so rather than pretending.
"""

from __future__ import annotations

import contextlib

import torch


def activation_offload_context(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager:
    """The context to run a training forward in: ``save_on_cpu(pin_memory=True)`` on a CUDA device when
    ``enabled``, else a no-op context."""
    if enabled and torch.device(device).type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()


def activation_offload_note(enabled: bool, device: torch.device) -> str | None:
    """The fit-start line's word on the knob (None when it is off)."""
    if not enabled:
        return None
    if torch.device(device).type == "cuda":
        return "activation offloading to pinned CPU memory"
    return f"activation_offloading has no effect on device '{torch.device(device).type}' (activations are already in CPU memory)"
