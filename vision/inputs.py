"""``ImageInputs``: the image tensors of a batch, kept per row so they follow the rows wherever a layout puts them.

A collator processes each row alone (``encode_row``) and keeps its image tensors; a method that repeats or reorders
rows (DPO's chosen and rejected rows sharing a prompt, GRPO's ``num_generations`` completions of a prompt, a
micro-batch split) selects the same rows of ``ImageInputs`` (``select``), and ``tensors`` builds exactly what the
model's forward takes, as the processor would for those rows processed together (``ImageKeyLayout`` says how).
``model_inputs`` is what every forward adds to ``input_ids``/``attention_mask``: the image tensors and the
token-aligned extras (``token_type_ids``, ``mm_token_type_ids``) the batch carries."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from lightalign.vision.processor import ImageKeyLayout


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """Per row, the image tensors the processor returned for that row alone (``{}`` for a row without images)."""

    rows: tuple[dict[str, torch.Tensor], ...]
    layout: ImageKeyLayout

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def images_per_row(self) -> list[int]:
        return [_image_count(row, self.layout) for row in self.rows]

    def select(self, index: Sequence[int] | torch.Tensor) -> ImageInputs:
        """The rows ``index`` in that order (repeats allowed: ``[0, 0, 1, 1]`` for two completions per prompt)."""
        index = index.tolist() if isinstance(index, torch.Tensor) else list(index)
        return ImageInputs(tuple(self.rows[i] for i in index), self.layout)

    def repeat_interleave(self, repeats: int) -> ImageInputs:
        """Each row ``repeats`` times in place (GRPO's completions of one prompt)."""
        return self.select([i for i in range(len(self.rows)) for _ in range(repeats)])

    @staticmethod
    def cat(parts: Sequence[ImageInputs]) -> ImageInputs:
        """The rows of ``parts`` one after the other (DPO's ``[chosen rows; rejected rows]``)."""
        return ImageInputs(tuple(row for part in parts for row in part.rows), parts[0].layout)

    def to(self, *args: Any, **kwargs: Any) -> ImageInputs:
        """Moved like a tensor (Lightning moves batch members that have ``to``); integer tensors keep their dtype."""
        def move(t: torch.Tensor) -> torch.Tensor:
            if t.is_floating_point():
                return t.to(*args, **kwargs)
            device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
            return t.to(device) if device is not None else t
        return ImageInputs(tuple({k: move(v) for k, v in row.items()} for row in self.rows), self.layout)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch's image tensors as the model's forward takes them (``{}`` when no row has an image)."""
        out: dict[str, torch.Tensor] = {}
        present = [row for row in self.rows if row]
        if not present:
            return out
        for key in self.layout.image_keys:
            parts = [row[key] for row in present if key in row]
            if parts:
                out[key] = torch.cat(parts, dim=0)
        for key in self.layout.row_keys:
            # one entry per row, rows without images included (all-zero images: what the processor pads with)
            template = next(row[key] for row in present if key in row)
            width = max(row[key].shape[1] if key in row else 0 for row in self.rows)
            padded = []
            for row in self.rows:
                value = row.get(key)
                shape = (1, width, *template.shape[2:])
                block = template.new_zeros(shape)
                if value is not None:
                    block[:, : value.shape[1]] = value
                padded.append(block)
            out[key] = torch.cat(padded, dim=0)
        return out


def _image_count(row: dict[str, torch.Tensor], layout: ImageKeyLayout) -> int:
    if not row:
        return 0
    if "image_grid_thw" in row:
        return int(row["image_grid_thw"].shape[0])
    for key in layout.image_keys:
        if key in row:
            return int(row[key].shape[0])
    for key in layout.row_keys:
        if key in row:
            return int(row[key].shape[1])
    return 0


def model_inputs(batch: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """What a forward adds for images: ``batch["image_inputs"].tensors()`` and the token-aligned extras of the
    batch's layout (``prefix`` + key, e.g. the ``prompt_`` columns of a rollout). ``{}`` for text batches."""
    images = batch.get(prefix + "image_inputs")
    if images is None:
        return {}
    out = dict(images.tensors())
    for key in images.layout.token_keys:
        if prefix + key in batch:
            out[key] = batch[prefix + key]
    return out
