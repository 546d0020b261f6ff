"""``SFTDataModule``: rows in TRL's SFT formats -> validated -> tokenized once -> padded or packed batches."""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Literal

import lightning as L
import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from lightalign.datamodules.collators import PaddingCollator, PaddingFreeCollator, pack_best_fit
from lightalign.datamodules.formats import (
    CONVERSATIONAL,
    LANGUAGE_MODELING,
    PROMPT_COMPLETION,
    DataFormatError,
    check_chat_template,
    detect_format,
    is_conversation,
    iter_rows,
    load_rows,
    render_prompt_completion,
    require_format,
    resolve_chat_template,
    validate_field,
    validate_messages,
    validate_text,
)
from lightalign.datamodules.step_loader import StepTokenCountingLoader
from lightalign.hub import load_tokenizer

TruncationMode = Literal["keep_start", "keep_end"]
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
            row["messages"],
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=assistant_only_loss,
        )
        ids = list(enc["input_ids"])
        mask = list(enc["assistant_masks"]) if assistant_only_loss else [1] * len(ids)
        return ids, mask
    raise DataFormatError(f"SFT cannot tokenize format '{fmt}'.")


def _tokenize_batch(batch: dict[str, list], tokenizer: Any, fmt: str, text_field: str, completion_only_loss: bool,
                    assistant_only_loss: bool, max_length: int | None, truncation_mode: str) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": [], "completion_mask": [], "untruncated_length": []}
    size = len(next(iter(batch.values())))
    for j in range(size):
        row = {k: v[j] for k, v in batch.items()}
        ids, mask = tokenize_sft_row(row, tokenizer, fmt, text_field, completion_only_loss, assistant_only_loss)
        out["untruncated_length"].append(len(ids))
        out["input_ids"].append(truncate(ids, max_length, truncation_mode))
        out["completion_mask"].append(truncate(mask, max_length, truncation_mode))
    return out


class SFTDataModule(L.LightningDataModule):
    """Batches for supervised fine-tuning from any TRL SFT dataset.

    Args:
        path: training data: a local json/jsonl/parquet/csv file or folder, a hub dataset name, or a ``Dataset``.
        tokenizer: a tokenizer or its name/path (the CLI links it to the model's ``model_name_or_path``).
        split: split of ``path`` to train on.
        name: dataset configuration name (hub datasets with several configs).
        val_path: validation data (same kinds as ``path``).
        val_split: a split of ``path`` to validate on (e.g. ``test``).
        val_split_size: carve this fraction (<1) or number (>=1) of rows out of the training data for validation.
        test_path: data for ``lightalign test`` (defaults to the validation data).
        dataset_text_field: the text column of language-modeling data.
        max_length: tokens per sequence after truncation (``None``: no truncation); the packing bin size.
        truncation_mode: ``keep_start`` keeps the first ``max_length`` tokens, ``keep_end`` the last ones.
        completion_only_loss: prompt-completion data: loss on completion tokens only (default: on).
        assistant_only_loss: conversational data: loss on assistant turns only (needs ``{% generation %}`` in the
            chat template).
        packing: pack sequences into bins of ``max_length`` tokens (best-fit decreasing), padding-free.
        padding_free: concatenate each batch into one row without padding (implied by ``packing``).
        batch_size: rows (or packed bins) per micro-batch per device.
        val_batch_size: per-device batch size for validation and test (default: ``batch_size``).
        chat_template: override the tokenizer's chat template (Jinja text or a path to a file).
        collator: a callable turning a list of tokenized rows (``input_ids``, ``completion_mask``) into a batch.
        num_workers: DataLoader workers.
        dataset_num_proc: processes for tokenization.
        shuffle: shuffle the training rows every epoch.
        seed: seed of the validation carve-out and of the shuffle order.
    """

    def __init__(
        self,
        path: str | Dataset | None = None,
        tokenizer: Any = None,
        *,
        split: str = "train",
        name: str | None = None,
        val_path: str | Dataset | None = None,
        val_split: str | None = None,
        val_split_size: float = 0.0,
        test_path: str | Dataset | None = None,
        dataset_text_field: str = "text",
        max_length: int | None = 1024,
        truncation_mode: TruncationMode = "keep_start",
        completion_only_loss: bool | None = None,
        assistant_only_loss: bool = False,
        packing: bool = False,
        padding_free: bool = False,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        chat_template: str | None = None,
        collator: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]] | None = None,
        num_workers: int = 0,
        dataset_num_proc: int | None = None,
        shuffle: bool = True,
        seed: int = 42,
    ) -> None:
        super().__init__()
        if path is None:
            raise ValueError("SFTDataModule needs `path`: a data file, a folder, a hub dataset name or a Dataset.")
        if tokenizer is None:
            raise ValueError("SFTDataModule needs `tokenizer` (a tokenizer or a model name/path).")
        if truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"truncation_mode='{truncation_mode}' is unknown; use keep_start or keep_end.")
        if packing and max_length is None:
            raise ValueError("packing needs max_length: it is the size of the packed bins.")
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}.")
        self.path, self.split, self.name = path, split, name
        self.val_path, self.val_split, self.val_split_size, self.test_path = val_path, val_split, val_split_size, test_path
        self.text_field = dataset_text_field
        self.max_length, self.truncation_mode = max_length, truncation_mode
        self.completion_only_loss = True if completion_only_loss is None else completion_only_loss
        self.assistant_only_loss = assistant_only_loss
        self.packing, self.padding_free = packing, padding_free or packing
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.chat_template = chat_template
        self.num_workers, self.dataset_num_proc = num_workers, dataset_num_proc
        self.shuffle, self.seed = shuffle, seed
        self._tokenizer_arg = tokenizer
        self.tokenizer = tokenizer if not isinstance(tokenizer, str) else None
        self.collator = collator
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self._prepared = False

    # ------------------------------------------------------------------------------------- setup
    def _load_tokenizer(self) -> Any:
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self._tokenizer_arg)
        template = resolve_chat_template(self.chat_template)
        if template is not None:
            self.tokenizer.chat_template = template
        return self.tokenizer

    def setup(self, stage: str | None = None) -> None:
        if self._prepared:
            return
        tokenizer = self._load_tokenizer()
        raw_train = load_rows(self.path, split=self.split, name=self.name)
        raw_val = None
        if self.val_path is not None:
            raw_val = load_rows(self.val_path, split="train" if self.val_split is None else self.val_split)
        elif self.val_split is not None:
            raw_val = load_rows(self.path, split=self.val_split, name=self.name)
        elif self.val_split_size:
            parts = raw_train.train_test_split(test_size=self.val_split_size, seed=self.seed, shuffle=True)
            raw_train, raw_val = parts["train"], parts["test"]
        self.train_dataset = self.prepare_rows(raw_train, tokenizer, "train")
        if raw_val is not None:
            self.val_dataset = self.prepare_rows(raw_val, tokenizer, "validation")
        if self.test_path is not None:
            self.test_dataset = self.prepare_rows(load_rows(self.test_path), tokenizer, "test")
        else:
            self.test_dataset = self.val_dataset
        self._prepared = True

    def prepare_rows(self, raw: Dataset, tokenizer: Any, label: str) -> Dataset:
        """Validate, tokenize (cached by datasets), truncate, drop rows with no target left, pack."""
        if len(raw) == 0:
            raise DataFormatError(f"The {label} split is empty: it has no rows.")
        fmt = detect_format(raw, self.text_field)
        require_format(fmt, (LANGUAGE_MODELING, PROMPT_COMPLETION, CONVERSATIONAL), "SFT", raw.column_names)
        self.validate(raw, fmt, tokenizer, label)
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
            ),
        )
        targets = [sum(m[1:]) for m in tokenized["completion_mask"]]
        keep = [i for i, t in enumerate(targets) if t > 0]
        if not keep:
            too_long = sum(n > (self.max_length or n) for n in tokenized["untruncated_length"])
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

    def validate(self, raw: Dataset, fmt: str, tokenizer: Any, label: str) -> None:
        """Check every row before any tokenization; errors name the row and the column."""
        first = raw[0]
        conversational = fmt == CONVERSATIONAL or (fmt == PROMPT_COMPLETION and is_conversation(first["prompt"]))
        if conversational:
            check_chat_template(tokenizer, f"{label} data, columns {raw.column_names}")
            if self.assistant_only_loss and not _GENERATION_TAG.search(tokenizer.chat_template or ""):
                raise DataFormatError(
                    "assistant_only_loss=True needs a chat template that marks assistant turns with "
                    "{% generation %} ... {% endgeneration %}; this tokenizer's template does not. Pass "
                    "data.chat_template with the markers or set assistant_only_loss=False."
                )
        if fmt == LANGUAGE_MODELING:
            for i, row in iter_rows(raw, [self.text_field]):
                validate_text(row[self.text_field], i, self.text_field)
        elif fmt == CONVERSATIONAL:
            for i, row in iter_rows(raw, ["messages"]):
                validate_messages(row["messages"], i, "messages", require_assistant=self.assistant_only_loss)
        else:
            for i, row in iter_rows(raw, ["prompt", "completion"]):
                validate_field(row["prompt"], i, "prompt")
                validate_field(row["completion"], i, "completion")
                if is_conversation(row["prompt"]) != conversational or isinstance(row["completion"], list) != conversational:
                    raise DataFormatError(
                        f"row {i}: 'prompt' and 'completion' must both be strings or both be message lists, like "
                        f"row 0 ({'message lists' if conversational else 'strings'})."
                    )

    def _pack(self, tokenized: Dataset) -> Dataset:
        ids, masks = tokenized["input_ids"], tokenized["completion_mask"]
        bins = pack_best_fit([len(x) for x in ids], self.max_length)
        rows = {"input_ids": [], "completion_mask": [], "seq_lengths": []}
        for members in bins:
            rows["input_ids"].append([t for i in members for t in ids[i]])
            rows["completion_mask"].append([t for i in members for t in masks[i]])
            rows["seq_lengths"].append([len(ids[i]) for i in members])
        return Dataset.from_dict(rows)

    # ------------------------------------------------------------------------------------- loaders
    def _collate(self) -> Callable:
        if self.collator is not None:
            return self.collator
        if self.padding_free:
            return PaddingFreeCollator()
        return PaddingCollator(self.tokenizer.pad_token_id)

    def train_dataloader(self) -> DataLoader:
        accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        return StepTokenCountingLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            collate_fn=self._collate(),
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
            accumulate_grad_batches=accumulate,
        )

    def _eval_loader(self, dataset: Dataset | None, what: str) -> DataLoader:
        if dataset is None:
            raise DataFormatError(f"No {what} data: set val_path, val_split or val_split_size (or test_path).")
        return DataLoader(dataset, batch_size=self.val_batch_size, collate_fn=self._collate(), num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            return []
        return self._eval_loader(self.val_dataset, "validation")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_dataset, "test")
