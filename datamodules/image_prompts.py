"""Prompt-only rows with images (TRL's ``images`` / ``image`` column) for a vision-language model's online methods.

Preparing a split checks every row early, naming it: its images open (``stored_images``, kept as ``{"bytes",
"path"}`` refs, not pixels), a conversational prompt names exactly as many image placeholders as the row has images
(``with_image_parts``: string contents get them at the first user turn, as TRL), and the prompt with its image tokens
expanded fits ``max_prompt_length`` (image tokens cannot be cut, so a longer prompt is refused, not truncated). The
collator (``ImagePromptCollator``) processes each row alone (``encode_row``) and hands the rollout the rows' image
tensors (``prompt_image_inputs``: ``ImageInputs``) and their token-aligned extras (``prompt_<key>``, left-padded
with 0 like the mask); the reward functions get the row's images as TRL gives them: PIL images under the data's own
column (``images``: a list per row, ``image``: one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from lightalign.datamodules.formats import DataFormatError, about_row, chat_messages, iter_rows, validate_field
from lightalign.vision.images import IMAGE_COLUMNS, load_image, stored_images

if TYPE_CHECKING:
    from datasets import Dataset

IMAGE_REFS = "image_refs"   # the prepared rows' images: {"bytes", "path"} refs (stored_images)
PROMPT_TEXT = "prompt_text"  # the prompt as the processor reads it: chat template applied, one placeholder per image
PREPARED_COLUMNS = (IMAGE_REFS, PROMPT_TEXT, "prompt_input_ids")


def image_column(column_names: Sequence[str]) -> str | None:
    """The data's image column (``images`` before ``image``, as TRL reads them), None without one."""
    return next((c for c in IMAGE_COLUMNS if c in column_names), None)


def text_view(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with each content-part list as one string (``<image>`` for an image part), so the checks of
    text conversations (roles, empty turns, tool calls) apply to it."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            text = "".join("<image>" if isinstance(p, dict) and p.get("type") == "image"
                           else str(p.get("text") or "") if isinstance(p, dict) else str(p) for p in content)
            message = {**message, "content": text}
        out.append(message)
    return out


def prepare_image_prompts(raw: Dataset, processor: Any, layout: Any, *, label: str, numbers: Any, base_dir: Any,
                          max_prompt_length: int | None, chat_template_kwargs: dict[str, Any] | None) -> Dataset:
    """The split's rows checked and prepared (see the module docstring): the image column replaced by ``image_refs``,
    plus ``prompt_text`` and ``prompt_input_ids`` (image tokens expanded)."""
    from lightalign.vision import encode_row, with_image_parts

    column = image_column(raw.column_names)
    refs, texts, ids = [], [], []
    conversational = isinstance(raw[0]["prompt"], list)
    for i, row in iter_rows(raw, ["prompt", *([column] if column else [])], numbers):
        where = f"{label} row {i}"
        with about_row(i):
            try:
                stored = stored_images(row, where=where, base_dir=base_dir)
                prompt = row["prompt"]
                if isinstance(prompt, list) != conversational:
                    raise DataFormatError(f"{where}, column 'prompt': mixes strings and conversations.")
                if not isinstance(prompt, list):
                    validate_field(prompt, i, "prompt")
                    if stored:
                        raise DataFormatError(
                            f"{where}: a prompt with images must be a conversation (a list of messages; TRL's rule), "
                            "so the chat template places the images; got a string. Give the prompt as "
                            "[{\"role\": \"user\", \"content\": ...}].")
                    text = prompt
                else:
                    messages = with_image_parts(chat_messages(prompt), len(stored), where=where)
                    validate_field(text_view(messages), i, "prompt")
                    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                         **(chat_template_kwargs or {}))
                images = [load_image(ref, where=where) for ref in stored]
                row_ids = (encode_row(processor, text, images, layout)[0] if isinstance(prompt, list)
                           else processor.tokenizer(text, add_special_tokens=True)["input_ids"])
            except DataFormatError:
                raise
            except ValueError as err:  # a missing image, a placeholder count: already naming the row
                raise DataFormatError(str(err)) from err
            if max_prompt_length is not None and len(row_ids) > max_prompt_length:
                raise DataFormatError(
                    f"{where}: the prompt has {len(row_ids)} tokens with its image tokens, more than "
                    f"max_prompt_length ({max_prompt_length}); image tokens cannot be truncated. Raise "
                    "max_prompt_length, or shrink the images (processor_kwargs, e.g. max_pixels).")
        refs.append(stored)
        texts.append(text)
        ids.append(row_ids)
    prepared = raw.remove_columns([c for c in IMAGE_COLUMNS if c in raw.column_names])
    return prepared.add_column(IMAGE_REFS, refs).add_column(PROMPT_TEXT, texts).add_column("prompt_input_ids", ids)


class ImagePromptCollator:
    """``PromptCollator``'s batch for rows with images (see the module docstring): ``prompt_input_ids`` /
    ``prompt_attention_mask`` left-padded, ``prompt_image_inputs`` (``ImageInputs``, batch row order), each
    token-aligned extra as ``prompt_<key>`` (left-padded with 0), ``prompts`` as in the data, and ``columns`` with
    the images as PIL images under ``column`` (the data's image column; None: it has none). ``left_pad``:
    ``PromptCollator``'s padding of prompt ids (``prompt.left_pad``), so both collators pad alike."""

    def __init__(self, processor: Any, layout: Any, column: str | None, left_pad: Callable) -> None:
        self.processor, self.layout, self.column, self.left_pad = processor, layout, column, left_pad

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        from lightalign.vision import ImageInputs, encode_row

        left_pad = self.left_pad

        encoded, images = [], []
        for row in rows:
            row_images = [load_image(ref, where="prompt row") for ref in row[IMAGE_REFS]]
            images.append(row_images)
            if row_images:
                encoded.append(encode_row(self.processor, row[PROMPT_TEXT], row_images, self.layout))
            else:  # no image in this row: the ids prepared (the tokenizer's, as a text prompt), zero extras
                ids = list(row["prompt_input_ids"])
                encoded.append((ids, {k: [0] * len(ids) for k in self.layout.token_keys}, {}))
        ids, mask = left_pad([e[0] for e in encoded], self.processor.tokenizer.pad_token_id)
        batch: dict[str, Any] = {"prompt_input_ids": ids, "prompt_attention_mask": mask,
                                 "prompt_image_inputs": ImageInputs(tuple(e[2] for e in encoded), self.layout)}
        for key in self.layout.token_keys:
            batch[f"prompt_{key}"] = left_pad([e[1].get(key, [0] * len(e[0])) for e in encoded], 0)[0]
        extra = [k for k in rows[0] if k not in ("prompt", *PREPARED_COLUMNS)]
        columns = {k: [r[k] for r in rows] for k in extra}
        if self.column is not None:  # the data's image column, as TRL hands it to reward functions
            columns[self.column] = images if self.column == "images" else [i[0] if i else None for i in images]
        batch["prompts"] = [chat_messages(r["prompt"]) if isinstance(r["prompt"], list) else r["prompt"] for r in rows]
        batch["columns"] = columns
        return batch


def repeated_prompt_inputs(batch: dict[str, Any], repeats: int) -> dict[str, Any]:
    """The image entries of a prompt batch (``prompt_image_inputs``, ``prompt_<key>``) with each row ``repeats``
    times in place, as the rollout's rows are (``{}`` for a text batch)."""
    images = batch.get("prompt_image_inputs")
    if images is None:
        return {}
    out: dict[str, Any] = {"prompt_image_inputs": images.repeat_interleave(repeats)}
    for key in images.layout.token_keys:
        if f"prompt_{key}" in batch:
            out[f"prompt_{key}"] = batch[f"prompt_{key}"].repeat_interleave(repeats, 0)
    return out


def has_image_rows(batch: dict[str, Any]) -> bool:
    """Whether a prompt batch (or a rollout) holds a row with an image."""
    images = batch.get("prompt_image_inputs")
    return images is not None and any(images.images_per_row)



def prompt_image_entries(rollout: dict[str, Any]) -> dict[str, Any]:
    """A rollout's per-row image entries (``prompt_image_inputs`` and the ``prompt_<key>`` extras; not the prompt
    ids or mask), to carry beside its tensors into every forward that scores its completions."""
    images = rollout.get("prompt_image_inputs")
    if images is None:
        return {}
    keys = ("prompt_image_inputs", *(f"prompt_{k}" for k in images.layout.token_keys))
    return {k: rollout[k] for k in keys if k in rollout}
