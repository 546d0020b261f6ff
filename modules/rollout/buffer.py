"""A rollout split into the micro-batches of ``training_step`` and reused across its calls.

Under automatic optimisation an online-RL module trains on one rollout over several ``training_step`` calls: the
first call of a rollout samples and scores it and splits it into micro-batches (``split_rollout``); every call
takes the next one (``RolloutBuffer.take``), for as many passes as the method makes over each rollout. Rows keep
their index in the rollout (``row``), so a stage that needs the whole rollout in order (group baselines, GAE
statistics) reads it with ``in_rollout_order`` and writes back with ``scatter_rows``.
"""

from __future__ import annotations

import dataclasses

from lightalign.knobs import KnobGroup, knob

from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightalign.modules.training.rng_state import to_cpu


@dataclasses.dataclass(frozen=True)
class RolloutKnobs(KnobGroup):
    """What one rollout of an online-RL method holds (groups of completions per prompt) and what is kept of it."""

    group = "rollout"
    num_generations: int = knob(8, "completions per prompt (the group).")
    num_generations_eval: int | None = knob(None, "completions per validation prompt (default ``num_generations``).")
    generation_batch_size: int | None = knob(
        None, "completions per rollout per device; must hold whole groups (a multiple of ``num_generations``) and "
              "split evenly into the method's micro-batches. Default: ``num_generations`` times the micro-batches "
              "per rollout.")
    mask_truncated_completions: bool = knob(False, "completions that hit ``max_completion_length`` without EOS get no "
                                                   "loss.")
    log_entropy: bool = knob(True, "log the mean token entropy of the policy on its completions.")

    def check(self) -> None:
        # num_generations' lower bound is the method's (its advantage's group size): OnlineRLModule checks it
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ValueError(f"num_generations_eval must be >= 1 or null (= num_generations), got "
                             f"{self.num_generations_eval}.")
        if self.generation_batch_size is not None and self.num_generations >= 1:
            check_generation_arithmetic(self.generation_batch_size, self.num_generations, None)

def check_generation_arithmetic(generation_batch_size: int, num_generations: int, steps: int | None) -> None:
    """``generation_batch_size`` holds whole groups and splits evenly into ``steps`` micro-batches."""
    if generation_batch_size % num_generations:
        raise ValueError(
            f"generation_batch_size ({generation_batch_size}) must be divisible by num_generations ({num_generations}): "
            f"{generation_batch_size} = {generation_batch_size // num_generations} x {num_generations} + "
            f"{generation_batch_size % num_generations}. Use a multiple of {num_generations}, e.g. "
            f"{(generation_batch_size // num_generations + 1) * num_generations}."
        )
    if steps and generation_batch_size % steps:
        raise ValueError(
            f"generation_batch_size ({generation_batch_size}) must split evenly into steps_per_generation ({steps}) "
            f"micro-batches: {generation_batch_size} / {steps} is not an integer."
        )


def split_rollout(tensors: dict[str, torch.Tensor], lengths: torch.Tensor, steps: int, num_generations: int,
                  whole_groups: bool) -> list[dict[str, torch.Tensor]]:
    """A rollout's rows, shuffled (the torch RNG), into ``steps`` micro-batches; each also gets ``lengths`` (its
    rows' completion lengths). ``whole_groups`` keeps each prompt's group in one micro-batch (prompt sharing);
    otherwise groups mix across micro-batches, as TRL does."""
    rows = lengths.shape[0]
    device = lengths.device
    if whole_groups:
        g = num_generations
        order = (torch.randperm(rows // g, device=device)[:, None] * g + torch.arange(g, device=device)).flatten()
    else:
        order = torch.randperm(rows, device=device)
    tensors = {k: take_rows(v, order) for k, v in tensors.items()}
    tensors["lengths"] = lengths[order]
    micro = rows // steps
    return [{k: take_rows(v, slice(i * micro, (i + 1) * micro)) for k, v in tensors.items()} for i in range(steps)]


def take_rows(value: Any, index: torch.Tensor | slice) -> Any:
    """Rows ``index`` of a per-row rollout entry: a tensor, or the prompts' ``ImageInputs`` (``select``)."""
    if isinstance(value, torch.Tensor):
        return value[index]
    rows = range(len(value))[index] if isinstance(index, slice) else index
    return value.select(rows)


def in_rollout_order(chunks: list[dict[str, torch.Tensor]], *keys: str) -> list[torch.Tensor]:
    """Each of ``keys`` over the whole rollout, rows back in the rollout's order (a prompt's group contiguous)."""
    order = torch.argsort(torch.cat([mb["row"] for mb in chunks]))
    return [torch.cat([mb[key] for mb in chunks])[order] for key in keys]


def scatter_rows(chunks: list[dict[str, torch.Tensor]], **per_row: torch.Tensor) -> None:
    """Write tensors in the rollout's order into the micro-batches holding their rows."""
    for mb in chunks:
        for key, value in per_row.items():
            mb[key] = value[mb["row"]]


def reshuffle_rollout(chunks: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The rollout's rows (every per-row tensor of its micro-batches) dealt into as many micro-batches of the same
    size, in a new random order (``torch.randperm`` on the rows' device)."""
    full = {}
    for key in chunks[0]:
        parts = [mb[key] for mb in chunks]
        if not all(isinstance(t, torch.Tensor) and t.shape[0] == mb["row"].shape[0] for t, mb in zip(parts, chunks)):
            raise TypeError(f"The rollout entry {key!r} is not one row per completion: it cannot be reshuffled.")
        full[key] = torch.cat(parts)
    order = torch.randperm(full["row"].shape[0], device=full["row"].device)
    size = chunks[0]["row"].shape[0]
    return [{k: v[order[i * size:(i + 1) * size]] for k, v in full.items()} for i in range(len(chunks))]


class RolloutBuffer:
    """The micro-batches of the rollout in training and the position of the next one (``micro_batches x passes``
    calls per rollout). Checkpointed per rank, so a resumed run continues mid-rollout exactly."""

    def __init__(self) -> None:
        self.chunks: list[dict[str, torch.Tensor]] | None = None
        self.pos = 0

    def used_up(self, micro_batches: int, passes: int) -> bool:
        return self.chunks is None or self.pos >= micro_batches * passes

    def fill(self, chunks: list[dict[str, torch.Tensor]]) -> None:
        self.chunks, self.pos = chunks, 0

    def starts_new_pass(self, micro_batches: int, passes: int) -> bool:
        """Whether the next micro-batch opens a pass over the rollout other than the first."""
        return self.chunks is not None and 0 < self.pos < micro_batches * passes and self.pos % micro_batches == 0

    def take(self, micro_batches: int, device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
        """The next micro-batch (on ``device``) and its slot in the rollout."""
        slot = self.pos % micro_batches
        self.pos += 1
        if self.chunks[slot]["row"].device != device:  # restored from a checkpoint (loaded on CPU)
            self.chunks = [move_data_to_device(chunk, device) for chunk in self.chunks]
        return self.chunks[slot], slot

    def step_tokens(self, slot: int, accumulate: int) -> torch.Tensor:
        """The completion tokens of the optimizer step ``slot`` belongs to (its ``accumulate`` micro-batches)."""
        start = (slot // accumulate) * accumulate
        return sum(self.chunks[i]["completion_mask"].sum() for i in range(start, start + accumulate))

    def state_dict(self) -> dict[str, Any]:
        """The micro-batches on the CPU, in plain containers (a prompt's images as ``image_state``), so a checkpoint
        loads with ``torch.load(weights_only=True)``, and the position."""
        chunks = None if self.chunks is None else [
            {k: image_state(v) if hasattr(v, "images_per_row") else v for k, v in to_cpu(mb).items()}
            for mb in self.chunks]
        return {"buffer": chunks, "buffer_pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        chunks = state.get("buffer")
        self.chunks = None if chunks is None else [
            {k: image_inputs_of(v) if isinstance(v, dict) and "image_rows" in v else v for k, v in mb.items()}
            for mb in chunks]
        self.pos = state.get("buffer_pos", 0)


def image_state(images: Any) -> dict[str, Any]:
    """A rollout's ``ImageInputs`` as plain containers of tensors and strings (``image_inputs_of`` rebuilds it)."""
    return {"image_rows": [dict(row) for row in images.rows], "image_layout": dataclasses.asdict(images.layout)}


def image_inputs_of(state: dict[str, Any]) -> Any:
    """The ``ImageInputs`` an ``image_state`` holds."""
    from lightalign.vision import ImageInputs
    from lightalign.vision.processor import ImageKeyLayout

    layout = ImageKeyLayout(**{k: tuple(v) for k, v in state["image_layout"].items()})
    return ImageInputs(tuple(state["image_rows"]), layout)
