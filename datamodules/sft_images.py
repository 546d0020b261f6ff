"""SFT rows with images (TRL's ``images``/``image`` columns) for a vision-language model.

At setup every row is checked and stored, not processed: its images opened (``stored_images``), its placeholders
counted against them (``with_image_parts`` for conversations, the processor's ``image_token`` in ``text`` rows),
conversations made ready for the chat template; errors name the row. Pixels are made in the collator, one row at a
time (``encode_sft_row``), as TRL's vision collator makes them (it processes the whole batch at once; a row alone
gives the same tokens and image tensors, ``ImageInputs`` batching them as the processor would).

Labels are TRL's: every token of a ``messages``/``text`` row, the assistant turns with ``assistant_only_loss``, the
completion of a prompt-completion row with ``completion_only_loss``; and, unlike TRL, never an image token (the
expanded image placeholders and every token the processor marks as multimodal in ``mm_token_type_ids`` /
``token_type_ids``): they are inputs, not text to predict. ``max_length`` cuts the end of a row (``keep_start``) only
after its last image token; a row whose image tokens reach past it is refused naming the row (a cut image would
leave pixels with no tokens to go to).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lightalign.datamodules.collators import IGNORE_INDEX
from lightalign.datamodules.formats import (CONVERSATIONAL, LANGUAGE_MODELING, DataFormatError, chat_messages,
                                            is_conversation, iter_rows, render_prompt_completion, validate_field,
                                            validate_messages, validate_text)
from lightalign.vision.images import image_column, load_image, stored_images
from lightalign.vision.inputs import ImageInputs
from lightalign.vision.messages import text_view, with_image_parts
from lightalign.vision.processor import ImageKeyLayout, encode_row, split_row

if TYPE_CHECKING:
    from datasets import Dataset

MESSAGES, TEXT, PROMPT_COMPLETION_ROW = "messages", "text", "prompt_completion"


def store_image_rows(raw: Dataset, fmt: str, processor: Any, *, label: str, text_field: str, numbers: Any,
                     base_dir: Any, assistant_only_loss: bool) -> Dataset:
    """Check every row of a split with images and return its stored form: ``row`` (the user's row number), ``kind``
    (``messages``/``text``/``prompt_completion``), ``text`` (the ``text`` row, or the prompt with the chat template
    applied), ``completion`` (its completion text), ``messages`` (JSON, the conversation with its image parts) and
    ``images`` (``stored_images``). Errors name the row."""
    from datasets import Dataset, Features, Value

    column = image_column(raw.column_names)
    columns = [c for c in (text_field, "messages", "prompt", "completion", "tools", column) if c in raw.column_names]
    rows: list[dict[str, Any]] = []
    for number, row in iter_rows(raw, columns, numbers):
        where = f"{label} row {number}"
        try:
            images = stored_images(row, where=where, base_dir=base_dir)
        except ValueError as err:
            raise DataFormatError(str(err)) from err
        stored = {"row": number, "kind": "", "text": "", "completion": "", "messages": "", "images": images}
        try:
            if fmt == CONVERSATIONAL:
                messages = with_image_parts(row["messages"], len(images), where=where)
                validate_messages(text_view(messages), number, "messages", require_assistant=assistant_only_loss)
                stored.update(kind=MESSAGES, messages=json.dumps({"messages": chat_messages(messages),
                                                                  "tools": row.get("tools")}))
            elif fmt == LANGUAGE_MODELING:
                validate_text(row[text_field], number, text_field)
                found = row[text_field].count(processor.image_token)
                if found != len(images):
                    raise DataFormatError(
                        f"{where}: the text holds {found} image placeholder(s) ('{processor.image_token}', the "
                        f"processor's image token) but the row has {len(images)} image(s); each image needs exactly "
                        "one placeholder where it is shown.")
                stored.update(kind=TEXT, text=row[text_field])
            else:
                stored.update(kind=PROMPT_COMPLETION_ROW, **_prompt_completion(row, processor, number, where,
                                                                              len(images)))
        except ValueError as err:  # with_image_parts and the template's prefix check name the row
            raise err if isinstance(err, DataFormatError) else DataFormatError(str(err)) from err
        rows.append(stored)
    features = Features({"row": Value("int64"), "kind": Value("string"), "text": Value("string"),
                         "completion": Value("string"), "messages": Value("string"),
                         "images": [{"bytes": Value("binary"), "path": Value("string")}]})
    return Dataset.from_list(rows, features=features)


def _prompt_completion(row: dict[str, Any], processor: Any, number: int, where: str, count: int) -> dict[str, str]:
    prompt, completion = row["prompt"], row["completion"]
    view = lambda value: text_view(value) if is_conversation(value) else value  # noqa: E731
    validate_field(view(prompt), number, "prompt")
    validate_field(view(completion), number, "completion")
    if is_conversation(prompt) != isinstance(completion, list):
        raise DataFormatError(f"{where}: 'prompt' and 'completion' must both be strings or both be message lists.")
    if is_conversation(prompt):
        prompt = with_image_parts(prompt, count, where=where)
        prompt_text, completion_text = render_prompt_completion(processor, prompt, completion)
        return {"text": prompt_text, "completion": completion_text}
    found = prompt.count(processor.image_token)
    if found != count:
        raise DataFormatError(f"{where}: the prompt holds {found} image placeholder(s) ('{processor.image_token}') "
                              f"but the row has {count} image(s); each image needs exactly one placeholder.")
    return {"text": prompt, "completion": completion}


def image_token_mask(ids: list[int], extras: dict[str, list[int]], processor: Any) -> list[bool]:
    """Which tokens of a processed row belong to an image: the processor's image token, and every token its
    ``mm_token_type_ids`` / ``token_type_ids`` mark as not text."""
    image_id = getattr(processor, "image_token_id", None)
    if image_id is None:
        image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    marks = [extras[k] for k in ("mm_token_type_ids", "token_type_ids") if k in extras]
    return [tok == image_id or any(m[i] for m in marks) for i, tok in enumerate(ids)]


def encode_sft_row(row: dict[str, Any], processor: Any, layout: ImageKeyLayout, *, completion_only_loss: bool,
                   assistant_only_loss: bool, max_length: int | None,
                   ) -> tuple[list[int], list[int], dict[str, list[int]], dict[str, torch.Tensor]]:
    """One stored row -> ``(input_ids, loss mask, token-aligned extras, image tensors)`` with its image tokens
    expanded, processed alone as TRL's collator processes it in a batch (no special tokens added: the chat template
    has them), then cut to ``max_length`` (refused inside an image's tokens, naming the row)."""
    images = [load_image(value, where=f"row {row['row']}") for value in row["images"]]
    if row["kind"] == MESSAGES:
        stored = json.loads(row["messages"])
        messages = _with_images(stored["messages"], images)
        out = processor.apply_chat_template(
            messages, tools=stored.get("tools"), tokenize=True, return_dict=True, return_tensors="pt",
            return_assistant_tokens_mask=assistant_only_loss, processor_kwargs={"add_special_tokens": False})
        ids, extras, tensors = split_row(out, layout, bool(images))
        mask = [int(m) for m in out["assistant_masks"][0]] if assistant_only_loss else [1] * len(ids)
    elif row["kind"] == TEXT:
        ids, extras, tensors = encode_row(processor, row["text"], images, layout)
        mask = [1] * len(ids)
    else:
        ids, extras, tensors = encode_row(processor, row["text"], images, layout)
        completion = processor.tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        mask = [0 if completion_only_loss else 1] * len(ids) + [1] * len(completion)
        ids = ids + list(completion)
        extras = {k: v + [0] * len(completion) for k, v in extras.items()}
    on_image = image_token_mask(ids, extras, processor)
    mask = [0 if image else m for m, image in zip(mask, on_image)]
    if max_length is not None and len(ids) > max_length:
        if any(on_image[max_length:]):
            last = max(i for i, image in enumerate(on_image) if image)
            raise ValueError(
                f"row {row['row']}: its image tokens reach token {last + 1} (of {len(ids)}, images expanded), past "
                f"max_length={max_length}: cutting the row there would cut an image. Raise max_length, or lower the "
                "image budget (processor_kwargs, e.g. max_pixels), or shorten the row.")
        ids, mask = ids[:max_length], mask[:max_length]
        extras = {k: v[:max_length] for k, v in extras.items()}
    return ids, mask, extras, tensors


def _with_images(messages: list[dict[str, Any]], images: list[Any]) -> list[dict[str, Any]]:
    """The image parts of a conversation holding the row's images in order (what ``apply_chat_template`` reads)."""
    remaining = iter(images)
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [{**part, "image": next(remaining)} if isinstance(part, dict) and part.get("type") == "image"
                       else part for part in content]
        out.append({**message, "content": content})
    return out


class ImageSFTCollator:
    """Stored image rows -> a right-padded batch: ``input_ids``, ``attention_mask``, ``labels`` (``-100`` off the
    loss mask), the token-aligned extras padded with 0, and ``image_inputs`` (``ImageInputs``, batch order)."""

    def __init__(self, processor: Any, layout: ImageKeyLayout, *, completion_only_loss: bool = True,
                 assistant_only_loss: bool = False, max_length: int | None = None) -> None:
        self.processor, self.layout = processor, layout
        self.options = dict(completion_only_loss=completion_only_loss, assistant_only_loss=assistant_only_loss,
                            max_length=max_length)
        self.pad_token_id = processor.tokenizer.pad_token_id

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        encoded = [encode_sft_row(row, self.processor, self.layout, **self.options) for row in rows]
        longest = max(len(ids) for ids, *_ in encoded)
        shape = (len(rows), longest)
        batch: dict[str, Any] = {"input_ids": torch.full(shape, self.pad_token_id, dtype=torch.long),
                                 "attention_mask": torch.zeros(shape, dtype=torch.long),
                                 "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.long)}
        for key in self.layout.token_keys:
            if any(key in extras for _, _, extras, _ in encoded):
                batch[key] = torch.zeros(shape, dtype=torch.long)
        for i, (ids, mask, extras, _) in enumerate(encoded):
            n = len(ids)
            batch["input_ids"][i, :n] = torch.tensor(ids)
            batch["attention_mask"][i, :n] = 1
            batch["labels"][i, :n] = torch.tensor([t if m else IGNORE_INDEX for t, m in zip(ids, mask)])
            for key, values in extras.items():
                batch[key][i, :n] = torch.tensor(values)
        batch["image_inputs"] = ImageInputs(tuple(tensors for *_, tensors in encoded), self.layout)
        return batch
