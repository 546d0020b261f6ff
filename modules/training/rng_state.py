"""Every RNG stream a run draws from (torch CPU/CUDA, numpy, python), saved per rank in checkpoints so a
resumed run draws exactly what the uninterrupted one would have."""

from __future__ import annotations

from typing import Any

import torch


def get_rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA), numpy and python random states, as plain tensors/tuples (``weights_only``-loadable)."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss)),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_per_rank(state: Any) -> list[Any]:
    """``state`` of every rank, in rank order (one entry without a process group): what a checkpoint keeps of
    each rank's own streams and buffers (every rank gathers; rank 0 writes)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        states: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(states, state)
        return states
    return [state]


def to_cpu(value: Any) -> Any:
    """Tensors (also inside dicts) on the CPU, for a checkpoint that loads on any device."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if hasattr(value, "images_per_row"):  # a rollout's prompt images (ImageInputs)
        return value.to("cpu")
    return value


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG state (rank order), so each rank resumes its own streams."""
    return gather_per_rank(get_rng_state())
