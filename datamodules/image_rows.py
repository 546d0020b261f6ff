"""Preference and unpaired rows with images (TRL's ``images`` / ``image`` columns) for a vision-language model.

At setup every row is checked naming it (``ImageRows.check_row``: its images open, its conversational prompt holds
one image placeholder per image or gets them as TRL's ``prepare_multimodal_messages`` places them, its completions
hold none), its image references are stored (``stored_images``) and its prompt is processed once with its images
(``ImageRows.expanded_prompt``), so the prompt's token ids carry the expanded image tokens: lengths, truncation and
the reference log-prob cache key see the tokens the model sees. An image row's prompt is never cut
(``check_prompt_whole``): its tokens are remade by the processor with the images in the collator, and a cut inside
an image's tokens would leave image features without their tokens (TRL then fails at the first forward).

In the collator ``PromptImages`` processes each prompt again with its images (``encode_row``) for the batch's
``image_inputs`` and the token-aligned extras (``mm_token_type_ids``, ``token_type_ids``); completion tokens are
text, so their extras are 0, as the processor gives them for text."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from lightalign.datamodules.formats import DataFormatError, is_conversation, render_prompt_completion
from lightalign.vision.images import IMAGE_COLUMNS, load_image, stored_images
from lightalign.vision.inputs import ImageInputs
from lightalign.vision.messages import count_image_parts, with_image_parts
from lightalign.vision.processor import ImageKeyLayout, encode_row

STORED = ("prompt_text", "images")  # the columns an image row adds to its tokenized row


def image_columns(columns: Sequence[str]) -> list[str]:
    """Every image column the data has (a JSONL file may give some rows ``images`` and others ``image``)."""
    return [c for c in IMAGE_COLUMNS if c in columns]


def check_text_model(raw: Any, processor: Any, label: str, tokenizer_name: Any) -> None:
    """Images given to a text model are refused naming the column (a text model would train on the text alone)."""
    if processor is not None:
        return
    for column in image_columns(raw.column_names):
        if not any(value for value in raw[column]):
            continue
        raise DataFormatError(
            f"The {label} data has an '{column}' column with images, and '{tokenizer_name}' is a text model (no "
            "image processor): its images would be ignored. Use a vision-language model, or drop the column.")


@dataclasses.dataclass(frozen=True)
class ImageRows:
    """What setup needs to check and tokenize image rows: the processor, its batch layout, the split's image folder."""

    processor: Any
    layout: ImageKeyLayout
    base_dir: Any = None

    def check_row(self, row: dict[str, Any], completions: Sequence[str], where: str) -> tuple[Any, list, list]:
        """``(prompt with its image parts, stored image refs, opened images)`` of one row; ``DataFormatError``
        naming ``where`` for an image that does not open, a placeholder count that differs from the images, images
        with a string prompt, or an image part in a completion."""
        try:
            stored = stored_images(row, where=where, base_dir=self.base_dir)
            images = [load_image(value, where=where) for value in stored]
        except ValueError as err:
            raise DataFormatError(str(err)) from err
        for key in completions:
            if is_conversation(row[key]) and count_image_parts(row[key]):
                raise DataFormatError(
                    f"{where}, column '{key}': the completion holds {count_image_parts(row[key])} image part(s); images "
                    "go in the prompt (TRL's formats), completions are text. Move the image parts to the prompt.")
        prompt = row["prompt"]
        if not is_conversation(prompt):
            if images:
                raise DataFormatError(
                    f"{where}: the row has {len(images)} image(s) and a string prompt; image rows need a "
                    "conversational prompt (a list of messages) where the chat template places the images. Write "
                    "the prompt as [{\"role\": \"user\", \"content\": ...}].")
            return prompt, stored, images
        try:
            return with_image_parts(prompt, len(images), where=where), stored, images
        except ValueError as err:
            raise DataFormatError(str(err)) from err

    def expanded_prompt(self, row: dict[str, Any], completion: str, tokenizer: Any, images: list,
                        prompt_ids: list[int]) -> tuple[str, list[int]]:
        """``(prompt text, prompt ids with each image's tokens expanded)``: ``prompt_ids`` is the prompt as the
        text tokenization split it from the completion (image placeholders unexpanded, possibly a few tokens shorter
        than the prompt text where a token straddles the split); the expanded ids drop the same tail."""
        if not images:
            return "", list(prompt_ids)
        text, _ = render_prompt_completion(tokenizer, row["prompt"], row[completion])
        tail = len(tokenizer(text, add_special_tokens=False)["input_ids"]) - len(prompt_ids)
        ids, _, _ = encode_row(self.processor, text, images, self.layout)
        return text, ids[: len(ids) - tail]


def check_prompt_whole(where: str, prompt: list[int], kept: list[int], has_images: bool, limits: str) -> None:
    """An image row's prompt must survive truncation whole (see the module docstring)."""
    if has_images and len(kept) != len(prompt):
        raise DataFormatError(
            f"{where}: its prompt has {len(prompt)} tokens with its images' tokens expanded, and fitting it to the "
            f"length limits ({limits}) would cut the prompt; an image row's prompt is kept whole (a cut inside an "
            "image's tokens leaves its features without their tokens). Raise max_prompt_length / max_length, use "
            "truncation_mode='keep_start', or lower the processor's image budget (processor_kwargs, e.g. max_pixels).")


class PromptImages:
    """Collator part: each row's prompt processed with its images -> ``(ImageInputs of the rows, per row the
    prompt's token-aligned extras)``; the prompt ids must be the ones setup stored (same processor, same images)."""

    def __init__(self, processor: Any, layout: ImageKeyLayout) -> None:
        self.processor, self.layout = processor, layout

    def __call__(self, rows: Sequence[dict[str, Any]]) -> tuple[ImageInputs, list[dict[str, list[int]]]]:
        tensors, extras = [], []
        for row in rows:
            n = len(row["prompt_input_ids"])
            if not row["images"]:
                tensors.append({})
                extras.append({key: [0] * n for key in self.layout.token_keys})
                continue
            where = f"{row.get('split', 'data')} row {row.get('index', '?')}"
            images = [load_image(value, where=where) for value in row["images"]]
            ids, row_extras, row_tensors = encode_row(self.processor, row["prompt_text"], images, self.layout)
            if ids[:n] != list(row["prompt_input_ids"]):
                raise RuntimeError(
                    f"{where}: its prompt processed with its images now gives other tokens than at setup (an image "
                    "file or the processor changed since the rows were tokenized). Clear the datasets cache of the "
                    "data, or restore the images.")
            tensors.append(row_tensors)
            extras.append({key: values[:n] for key, values in row_extras.items()})
        return ImageInputs(tuple(tensors), self.layout), extras


def pad_token_extras(pieces: Sequence[tuple[dict[str, list[int]], int]], keys: Sequence[str], width: int,
                     max_length: int | None = None) -> dict[str, torch.Tensor]:
    """Token-aligned extras ``[N, width]`` of sequences made of a prompt (its extras) and ``n`` completion tokens
    (extras 0), right-padded with 0 like ``attention_mask`` and cut to ``max_length`` like the sequences."""
    out = {key: torch.zeros((len(pieces), width), dtype=torch.long) for key in keys}
    for i, (prompt_extras, completion) in enumerate(pieces):
        for key in keys:
            values = list(prompt_extras.get(key, ())) + [0] * completion
            values = values[:max_length] if max_length is not None else values
            out[key][i, : len(values)] = torch.tensor(values, dtype=torch.long)
    return out

