"""``SFTDataModule``: rows in TRL's SFT formats -> validated -> tokenized once -> padded or packed batches."""

from __future__ import annotations

import re
import warnings
from typing import TYPE_CHECKING, Any, Callable, Literal


from lightalign.datamodules.base import TokenizedDataModule
from lightalign.datamodules.check_verdicts import value_hash
from lightalign.datamodules.sources import DataSource
from lightalign.datamodules.index_samplers import EpochSampler, LengthGroupedSampler
from lightalign.datamodules.collators import PaddingCollator, PaddingFreeCollator, pack_best_fit
from lightalign.datamodules.formats import (
    CONVERSATIONAL,
    LANGUAGE_MODELING,
    PROMPT_COMPLETION,
    DataFormatError,
    chat_messages,
    check_chat_template,
    detect_format,
    is_conversation,
    iter_rows,
    render_prompt_completion,
    require_format,
    validate_field,
    validate_messages,
    validate_text,
)

if TYPE_CHECKING:  # datasets (with pandas, pyarrow) is imported where rows are read, not for --help
    from datasets import Dataset

TruncationMode = Literal["keep_start", "keep_end"]
# Part of the datasets cache fingerprint of tokenized rows (datasets hashes a module's function by its name, not its
# code): bump it whenever tokenization changes its output, so caches written by an older lightalign are not reused.
# 1: tool-call arguments given as a JSON string are rendered as the object (``formats.chat_messages``).
TOKENIZATION_VERSION = 1
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def truncate(ids: list[int], max_length: int | None, mode: str) -> list[int]:
    """Keep the first (``keep_start``) or the last (``keep_end``) ``max_length`` tokens."""
    if max_length is None or len(ids) <= max_length:
        return ids
    return ids[:max_length] if mode == "keep_start" else ids[len(ids) - max_length :]


def tokenize_sft_row(
    row: dict[str, Any],
    tokenizer: Any,
    fmt: str,
    text_field: str = "text",
    completion_only_loss: bool = True,
    assistant_only_loss: bool = False,
) -> tuple[list[int], list[int]]:
    """One row -> (``input_ids``, ``completion_mask``) before truncation; 1 in the mask = a loss target."""
    eos = tokenizer.eos_token_id
    if fmt == LANGUAGE_MODELING:
        ids = tokenizer(row[text_field], add_special_tokens=True)["input_ids"]
        if eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]
        return ids, [1] * len(ids)
    if fmt == PROMPT_COMPLETION:
        prompt, completion = row["prompt"], row["completion"]
        if is_conversation(prompt):
            prompt_text, completion_text = render_prompt_completion(tokenizer, prompt, completion)
            prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
            completion_ids = tokenizer(completion_text, add_special_tokens=False)["input_ids"]
        else:
            prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
            completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
            if eos is not None:
                completion_ids = completion_ids + [eos]
        mask = [0 if completion_only_loss else 1] * len(prompt_ids) + [1] * len(completion_ids)
        return prompt_ids + completion_ids, mask
    if fmt == CONVERSATIONAL:
        enc = tokenizer.apply_chat_template(
            chat_messages(row["messages"]),
            tools=row.get("tools"),  # TRL's column: tool schemas the template renders (tool-calling transcripts)
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=assistant_only_loss,
        )
        ids = list(enc["input_ids"])
        mask = list(enc["assistant_masks"]) if assistant_only_loss else [1] * len(ids)
        return ids, mask
    raise DataFormatError(f"SFT cannot tokenize format '{fmt}'.")


def _tokenize_batch(batch: dict[str, list], tokenizer: Any, fmt: str, text_field: str, completion_only_loss: bool,
                    assistant_only_loss: bool, max_length: int | None, truncation_mode: str,
                    version: int = TOKENIZATION_VERSION) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": [], "completion_mask": [], "untruncated_length": []}
    size = len(next(iter(batch.values())))
    for j in range(size):
        row = {k: v[j] for k, v in batch.items()}
        ids, mask = tokenize_sft_row(row, tokenizer, fmt, text_field, completion_only_loss, assistant_only_loss)
        out["untruncated_length"].append(len(ids))
        out["input_ids"].append(truncate(ids, max_length, truncation_mode))
        out["completion_mask"].append(truncate(mask, max_length, truncation_mode))
    return out


class SFTDataModule(TokenizedDataModule):
    """Batches for supervised fine-tuning from any TRL SFT dataset (language modeling, prompt-completion,
    conversational).

    Args:
        path: training data: a local json/jsonl/parquet/csv file or folder, a hub dataset name, or a ``Dataset``.
        tokenizer: a tokenizer or its name/path (the CLI links it to the model's ``model_name_or_path``).
        dataset_text_field: the text column of language-modeling data.
        max_length: tokens per sequence after truncation (``None``: no truncation); the packing bin size.
        truncation_mode: ``keep_start`` keeps the first ``max_length`` tokens, ``keep_end`` the last ones.
        completion_only_loss: prompt-completion data: loss on completion tokens only (default: on).
        assistant_only_loss: conversational data: loss on assistant turns only (needs ``{% generation %}`` in the
            chat template).
        packing: pack sequences into bins of ``max_length`` tokens (best-fit decreasing), padding-free.
        padding_free: concatenate each batch into one row without padding (implied by ``packing``).
        group_by_length: batch rows of similar length together (``LengthGroupedSampler``: seeded mega-batches
            of 50 batches sorted by length), which cuts the padding of padded batches; not with ``packing``.
        **kwargs: the shared arguments of ``TokenizedDataModule``: ``split``, ``name``, ``val_path``,
            ``val_split``, ``val_split_size``, ``test_path``, ``batch_size``, ``val_batch_size``,
            ``chat_template``, ``collator``, ``num_workers``, ``dataset_num_proc``, ``shuffle``, ``seed``.
    """

    def __init__(
        self,
        path: DataSource = None,
        tokenizer: Any = None,
        *,
        dataset_text_field: str = "text",
        max_length: int | None = 1024,
        truncation_mode: TruncationMode = "keep_start",
        completion_only_loss: bool | None = None,
        assistant_only_loss: bool = False,
        packing: bool = False,
        padding_free: bool = False,
        group_by_length: bool = False,
        **kwargs: Any,
    ) -> None:
        if truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"truncation_mode='{truncation_mode}' is unknown; use keep_start or keep_end.")
        if packing and max_length is None:
            raise ValueError("packing needs max_length: it is the size of the packed bins.")
        if packing and group_by_length:
            raise ValueError("group_by_length sorts rows by length for padded batches; packed bins have no padding "
                             "to save. Use one of packing / group_by_length.")
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}.")
        super().__init__(path, tokenizer, **kwargs)
        self.text_field = dataset_text_field
        self.max_length, self.truncation_mode = max_length, truncation_mode
        self.completion_only_loss = True if completion_only_loss is None else completion_only_loss
        self.assistant_only_loss = assistant_only_loss
        self.packing, self.padding_free = packing, padding_free or packing
        self.group_by_length = group_by_length
        self.image_rows = False  # the splits hold images: stored rows, processed per row by ImageSFTCollator

    def prepare_rows(self, raw: Dataset, tokenizer: Any, label: str) -> Dataset:
        """Validate, tokenize (cached by datasets), truncate, drop rows with no target left, pack."""
        if len(raw) == 0:
            raise DataFormatError(f"The {label} split is empty: it has no rows.")
        fmt = detect_format(raw, self.text_field)
        self.data_format = fmt  # named in the export's model card
        require_format(fmt, (LANGUAGE_MODELING, PROMPT_COMPLETION, CONVERSATIONAL), "SFT", raw.column_names)
        if self.check_image_data(raw, label):
            self.validate(raw, fmt, tokenizer, label, text_checks=False)
            from lightalign.datamodules.sft_images import store_image_rows

            return store_image_rows(raw, fmt, self.processor, label=label, text_field=self.text_field,
                                    numbers=self.row_numbers, base_dir=self.image_base_dir,
                                    assistant_only_loss=self.assistant_only_loss)
        settings = {"format": fmt, "text_field": self.text_field, "assistant_only_loss": self.assistant_only_loss,
                    "chat_template": value_hash(getattr(tokenizer, "chat_template", None))}
        self.validate_once(raw, settings, lambda: self.validate(raw, fmt, tokenizer, label))
        tokenized = raw.map(
            _tokenize_batch,
            batched=True,
            remove_columns=raw.column_names,
            num_proc=self.dataset_num_proc,
            desc=f"Tokenizing {label}",
            fn_kwargs=dict(
                tokenizer=tokenizer,
                fmt=fmt,
                text_field=self.text_field,
                completion_only_loss=self.completion_only_loss,
                assistant_only_loss=self.assistant_only_loss,
                max_length=self.max_length,
                truncation_mode=self.truncation_mode,
                version=TOKENIZATION_VERSION,
            ),
        )
        targets = [sum(m[1:]) for m in tokenized["completion_mask"][:]]  # one read of the column, not one per row
        keep = [i for i, t in enumerate(targets) if t > 0]
        if not keep:
            too_long = sum(n > (self.max_length or n) for n in tokenized["untruncated_length"][:])
            raise DataFormatError(
                f"No {label} row has a loss token left: all {len(tokenized)} rows lost their targets "
                f"({too_long} of them are longer than max_length={self.max_length} and were cut with "
                f"truncation_mode='{self.truncation_mode}'). Raise max_length or use truncation_mode='keep_end'."
            )
        if len(keep) < len(tokenized):
            warnings.warn(
                f"{len(tokenized) - len(keep)} of {len(tokenized)} {label} rows have no loss token left after "
                f"truncation to max_length={self.max_length} ({self.truncation_mode}) and are dropped.",
                stacklevel=2,
            )
            tokenized = tokenized.select(keep)
        tokenized = tokenized.remove_columns("untruncated_length")
        if self.packing:
            tokenized = self._pack(tokenized)
        return tokenized

    def check_image_data(self, raw: Dataset, label: str) -> bool:
        """Whether the split holds images (an ``images``/``image`` column); refuses image data the run cannot train
        exactly: a text-only model, ``packing``/``padding_free`` (``refuse_image_layout``: the difference measured on the
        model, or what is not built), ``truncation_mode='keep_end'`` (it would cut the image tokens at the
        start, as TRL refuses), ``group_by_length`` (lengths are known only once the images are processed)."""
        from lightalign.vision.images import image_column

        column = image_column(raw.column_names)
        if column is None:
            if self.image_rows:
                raise DataFormatError(f"The {label} split has no 'images'/'image' column, and the training split has "
                                      "one: give every split its images (an empty list for a row without any).")
            return False
        if self.processor is None:
            raise DataFormatError(f"The {label} data has an image column '{column}', and '{self._tokenizer_arg}' is a "
                                  "text-only model (no image processor): use a vision-language model, or drop the "
                                  f"'{column}' column.")
        if self.packing or self.padding_free:  # measured on the model: the difference, or what is not built
            from lightalign.modules.adaptations.vision_probe import refuse_image_layout

            refuse_image_layout(self._tokenizer_arg, "packed" if self.packing else "padding_free", self.processor,
                                "SFTDataModule's collator does not build padding-free rows with images")
        for knob, value, fix in (("group_by_length", self.group_by_length, "group_by_length=False"),
                                 ("truncation_mode", self.truncation_mode == "keep_end" and self.max_length,
                                  "truncation_mode='keep_start' or max_length=None")):
            if value:
                raise DataFormatError(f"{knob} is not supported for SFT data with images (column '{column}'): "
                                      f"set {fix}.")
        self.image_rows = True
        return True

    def validate(self, raw: Dataset, fmt: str, tokenizer: Any, label: str, text_checks: bool = True) -> None:
        """Check every row before any tokenization; errors name the row and the column (``text_checks=False``: the
        chat template only; ``store_image_rows`` checks the rows of image data)."""
        first, first_number = raw[0], self.row_numbers[0] if self.row_numbers else 0
        conversational = fmt == CONVERSATIONAL or (fmt == PROMPT_COMPLETION and is_conversation(first["prompt"]))
        if conversational:
            check_chat_template(tokenizer, f"{label} data, columns {raw.column_names}")
            if self.assistant_only_loss and not _GENERATION_TAG.search(tokenizer.chat_template or ""):
                raise DataFormatError(
                    "assistant_only_loss=True needs a chat template that marks assistant turns with "
                    "{% generation %} ... {% endgeneration %}; this tokenizer's template does not. Pass "
                    "data.chat_template with the markers or set assistant_only_loss=False."
                )
        if not text_checks:
            return
        if fmt == LANGUAGE_MODELING:
            for i, row in iter_rows(raw, [self.text_field], self.row_numbers):
                validate_text(row[self.text_field], i, self.text_field)
        elif fmt == CONVERSATIONAL:
            for i, row in iter_rows(raw, ["messages"], self.row_numbers):
                validate_messages(row["messages"], i, "messages", require_assistant=self.assistant_only_loss)
        else:
            for i, row in iter_rows(raw, ["prompt", "completion"], self.row_numbers):
                validate_field(row["prompt"], i, "prompt")
                validate_field(row["completion"], i, "completion", follows=row["prompt"])
                if is_conversation(row["prompt"]) != conversational or isinstance(row["completion"], list) != conversational:
                    raise DataFormatError(
                        f"row {i}: 'prompt' and 'completion' must both be strings or both be message lists, like "
                        f"row {first_number} ({'message lists' if conversational else 'strings'})."
                    )

    def _pack(self, tokenized: Dataset) -> Dataset:
        ids, masks = tokenized["input_ids"][:], tokenized["completion_mask"][:]  # lists: a Column reads per index
        bins = pack_best_fit([len(x) for x in ids], self.max_length)
        rows = {"input_ids": [], "completion_mask": [], "seq_lengths": []}
        for members in bins:
            rows["input_ids"].append([t for i in members for t in ids[i]])
            rows["completion_mask"].append([t for i in members for t in masks[i]])
            rows["seq_lengths"].append([len(ids[i]) for i in members])
        from datasets import Dataset

        return Dataset.from_dict(rows)

    def make_epoch_sampler(self) -> EpochSampler:
        if not self.group_by_length:
            return super().make_epoch_sampler()
        lengths = [len(ids) for ids in self.train_dataset["input_ids"][:]]
        return LengthGroupedSampler(lengths, self.batch_size, **self.sampler_kwargs())

    def default_collator(self) -> Callable:
        if self.image_rows:
            from lightalign.datamodules.sft_images import ImageSFTCollator

            return ImageSFTCollator(self.processor, self.image_layout, completion_only_loss=self.completion_only_loss,
                                    assistant_only_loss=self.assistant_only_loss, max_length=self.max_length)
        if self.padding_free:
            return PaddingFreeCollator()
        return PaddingCollator(self.tokenizer.pad_token_id)
