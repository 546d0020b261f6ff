"""The processor of a vision-language model and the shape of what it returns.

``load_processor`` loads the model folder's processor (tokenizer + image processor + chat template). Processors that
also carry a video processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, SmolVLM) cannot be built by transformers without
torchvision; lightalign trains on images, so there they are built image-only: the same class, its video half absent
(a video in a row is then refused by the processor itself).

``ImageKeyLayout`` says, per tensor the processor returns, how a batch of rows is made from rows processed one at a
time: token-aligned tensors (``token_type_ids``, ``mm_token_type_ids``) follow ``input_ids``; per-image tensors
(``pixel_values``, ``image_grid_thw``, ``image_sizes``) concatenate along dim 0; per-row tensors (Idefics3/SmolVLM's
``[rows, images, ...]`` ``pixel_values`` and ``pixel_attention_mask``) pad along dim 1. It is measured by processing
a one-image and a two-image row (``measure_key_layout``), not listed per family."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

TEXT_KEYS = ("input_ids", "attention_mask")


def _processor_class(name_or_path: str, trust_remote_code: bool) -> type | None:
    """The processor class the folder names (``processor_config.json`` / ``tokenizer_config.json``), else the
    model type's default; None when transformers has none (remote code decides then)."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    folder = Path(name_or_path).expanduser()
    for file in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        if (folder / file).is_file():
            name = json.loads((folder / file).read_text()).get("processor_class")
            if name and hasattr(transformers, name):
                return getattr(transformers, name)
    from lightalign.hub import _hub_kwargs

    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **_hub_kwargs(name_or_path))
    name = PROCESSOR_MAPPING_NAMES.get(getattr(config, "model_type", None))
    return getattr(transformers, name) if name and hasattr(transformers, name) else None


def _image_only(cls: type) -> type:
    """``cls`` without its video processor: the same name and methods, ``get_attributes`` minus ``video_processor``
    (what ``from_pretrained``, ``__init__`` and ``save_pretrained`` iterate)."""
    attributes = [a for a in cls.get_attributes() if a != "video_processor"]
    return type(cls.__name__, (cls,), {"get_attributes": classmethod(lambda _: list(attributes)),
                                       "__module__": cls.__module__, "__doc__": cls.__doc__})


def load_processor(name_or_path: str, processor_kwargs: dict[str, Any] | None = None,
                   trust_remote_code: bool = False):
    """The model's processor (``AutoProcessor``), image-only where its video processor needs torchvision and
    torchvision is absent. ``processor_kwargs`` go to ``from_pretrained`` (``min_pixels``, ``max_pixels``,
    ``size`` ...: the image budget)."""
    from transformers import AutoProcessor

    from lightalign.hub import _check_local_folder, _hub_kwargs
    from lightalign.vision.images import require_pillow

    require_pillow()  # transformers' own error names torchvision first, which is not what lightalign needs

    _check_local_folder(name_or_path, "Processor")
    kwargs = {**_hub_kwargs(name_or_path), **(processor_kwargs or {})}
    cls = _processor_class(name_or_path, trust_remote_code)
    if (cls is not None and "video_processor" in cls.get_attributes()
            and importlib.util.find_spec("torchvision") is None):
        return _image_only(cls).from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)
    return AutoProcessor.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)


@dataclasses.dataclass(frozen=True)
class ImageKeyLayout:
    """How each processor output is batched (see the module docstring)."""

    token_keys: tuple[str, ...]      # shaped like input_ids: follow the tokens (padding, concatenation, packing)
    image_keys: tuple[str, ...]      # one leading entry per image (or per patch of an image): concatenate on dim 0
    row_keys: tuple[str, ...]        # one leading entry per row, images on dim 1: pad dim 1, concatenate on dim 0

    @property
    def keys(self) -> tuple[str, ...]:
        return self.token_keys + self.image_keys + self.row_keys


def _probe_images(count: int):
    from PIL import Image

    colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]
    return [Image.new("RGB", (56 + 28 * i, 56), colours[i % 3]) for i in range(count)]


def measure_key_layout(processor: Any) -> ImageKeyLayout:
    """Process a one-image and a two-image row alone and classify every returned tensor: same shape as
    ``input_ids`` -> token-aligned; leading dim grows with the images -> per image; leading dim 1 both times ->
    per row."""
    outs = []
    for count in (1, 2):
        messages = [{"role": "user", "content": [*({"type": "image"} for _ in range(count)),
                                                  {"type": "text", "text": "what is shown?"}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        outs.append(processor(text=[text], images=[_probe_images(count)], return_tensors="pt",
                              add_special_tokens=False))
    token, image, row = [], [], []
    for key in outs[0]:
        if key in TEXT_KEYS or not isinstance(outs[0][key], torch.Tensor):
            continue
        one, two = outs[0][key], outs[1][key]
        if one.shape == outs[0]["input_ids"].shape and two.shape == outs[1]["input_ids"].shape:
            token.append(key)
        elif two.shape[0] > one.shape[0]:
            image.append(key)
        elif one.shape[0] == 1 and two.shape[0] == 1 and one.dim() >= 2:
            row.append(key)
        else:
            raise ValueError(f"The processor's output '{key}' has shapes {tuple(one.shape)} (one image) and "
                             f"{tuple(two.shape)} (two images): neither per token, per image nor per row, so "
                             "lightalign cannot batch it. Please report the model.")
    return ImageKeyLayout(tuple(token), tuple(image), tuple(row))


def encode_row(processor: Any, text: str, images: list[Any], layout: ImageKeyLayout,
               ) -> tuple[list[int], dict[str, list[int]], dict[str, torch.Tensor]]:
    """One row's text (chat template already applied, one placeholder per image) and images through the processor:
    ``(input_ids, token-aligned extras, image tensors)``; the image tokens are expanded in ``input_ids``."""
    out = processor(text=[text], images=[images] if images else None, return_tensors="pt", add_special_tokens=False)
    return split_row(out, layout, bool(images))


def split_row(out: Any, layout: ImageKeyLayout, has_images: bool,
              ) -> tuple[list[int], dict[str, list[int]], dict[str, torch.Tensor]]:
    """A one-row processor output -> ``(input_ids, token-aligned extras, image tensors)`` (``{}`` without images)."""
    ids = [int(t) for t in out["input_ids"][0]]
    extras = {k: [int(t) for t in out[k][0]] for k in layout.token_keys if k in out}
    tensors = {k: out[k] for k in layout.image_keys + layout.row_keys if k in out} if has_images else {}
    return ids, extras, tensors
