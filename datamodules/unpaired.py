"""``UnpairedPreferenceDataModule``: rows judged one at a time (``prompt``, ``completion``, ``label``) -> validated
-> tokenized -> batches with the mismatched sequences KTO estimates its KL term from.

Paired preference rows (``prompt``/``chosen``/``rejected``, or implicit prompt) are unpaired on the fly as TRL does:
each pair gives one desirable row (``chosen``, ``label: true``) and one undesirable row (``rejected``,
``label: false``); within each block of 1,000 pairs the desirable rows come first, then the undesirable ones (the
row order of TRL's ``unpair_preference_dataset``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from lightalign.datamodules.base import TokenizedDataModule
from lightalign.datamodules.check_verdicts import value_hash
from lightalign.datamodules.sources import DataSource
from lightalign.datamodules.formats import (
    DataFormatError,
    check_chat_template,
    detect_format,
    is_conversation,
    iter_rows,
    render_prompt_completion,
    validate_field,
)
from lightalign.datamodules.preference import TruncationMode, common_prefix_length, extract_prompt, truncate_pair
from lightalign.vision.images import image_column
from lightalign.datamodules.image_rows import (ImageRows, PromptImages, check_prompt_whole, check_text_model,
                                               image_columns, pad_token_extras)
from lightalign.vision.images import row_image_values

if TYPE_CHECKING:  # datasets (with pandas, pyarrow) is imported where rows are read, not for --help
    from datasets import Dataset

# Part of the datasets cache fingerprint of tokenized rows: bump it whenever tokenization changes its output.
# 2: tool-call arguments given as a JSON string are rendered as the object (``formats.chat_messages``).
TOKENIZATION_VERSION = 2
# TRL's unpairing maps batches of this many pairs (datasets' default): chosen rows of a block, then rejected rows.
UNPAIR_BLOCK = 1000


def unpair_rows(raw: Dataset, implicit: bool, numbers: list[int] | None = None) -> Dataset:
    """Paired rows -> unpaired rows (``prompt``, ``completion``, ``label``, ``pair``: the source row index; and
    ``images``, each row its pair's images, when the data has an image column).

    ``numbers``: the rows' numbers in the user's data, for errors (``formats.iter_rows``)."""
    prompts, completions, labels, pairs = [], [], [], []
    rows = list(iter_rows(raw, ["chosen", "rejected"] if implicit else ["prompt", "chosen", "rejected"]))
    for start in range(0, len(rows), UNPAIR_BLOCK):
        block = rows[start : start + UNPAIR_BLOCK]
        split = []
        for i, row in block:
            if implicit:
                number = i if numbers is None else numbers[i]
                split.append((i, *extract_prompt(row["chosen"], row["rejected"], number)))
            else:
                split.append((i, row["prompt"], row["chosen"], row["rejected"]))
        for label, position in ((True, 2), (False, 3)):
            for item in split:
                prompts.append(item[1])
                completions.append(item[position])
                labels.append(label)
                pairs.append(item[0])
    from datasets import Dataset

    columns = {"prompt": prompts, "completion": completions, "label": labels, "pair": pairs}
    if image_column(raw.column_names) is not None:  # each pair's images as a list (from 'images' or 'image')
        table = raw.select_columns(image_columns(raw.column_names))
        per_pair = [row_image_values(row) for row in table]
        columns["images"] = [per_pair[p] for p in pairs]
    return Dataset.from_dict(columns)


def tokenize_unpaired_row(prompt: Any, completion: Any, tokenizer: Any) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) before truncation.

    ``prompt + completion`` is tokenized as one text and split where it stops starting with the tokenized prompt,
    as ``tokenize_preference_row`` does (and TRL); EOS ends string completions unless already there;
    conversations go through the chat template (the completion ends where the template closes the turn).
    """
    if is_conversation(prompt):
        prompt_text, completion_text = render_prompt_completion(tokenizer, prompt, completion)
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        whole = tokenizer(prompt_text + completion_text, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        whole = tokenizer(prompt + completion, add_special_tokens=True)["input_ids"]
        eos = tokenizer.eos_token_id
        if eos is not None and whole[-1:] != [eos]:
            whole = whole + [eos]
    split = common_prefix_length(prompt_ids, whole)
    return prompt_ids[:split], whole[split:]


def kl_partners(n: int, block: int) -> list[int]:
    """For each row, the row whose completion it is paired with to estimate KTO's KL term.

    TRL's construction: consecutive blocks of ``block`` rows (the micro-batch size), each completion moved one
    place down within its block: ``(x1, yk), (x2, y1), …, (xk, yk-1)``. Unlike TRL, a last block of one row (whose
    only partner would be itself, a matched pair) takes the completion of the row before it.
    """
    partners = []
    for start in range(0, n, block):
        stop = min(start + block, n)
        if stop - start == 1 and start > 0:
            partners.append(start - 1)
            continue
        partners.extend([stop - 1] + list(range(start, stop - 1)))
    return partners


def _tokenize_batch(batch: dict[str, list], indices: list[int], tokenizer: Any, max_length: int | None,
                    max_prompt_length: int | None, max_completion_length: int | None, truncation_mode: str,
                    split: str, version: int = TOKENIZATION_VERSION, image_rows: ImageRows | None = None,
                    ) -> dict[str, list]:
    out: dict[str, list] = {"prompt_input_ids": [], "completion_input_ids": [], "label": [], "split": [], "index": []}
    for j, row_index in enumerate(indices):
        where = f"row {row_index}" if batch["pair"][j] < 0 else f"pair row {batch['pair'][j]}"
        prompt = batch["prompt"][j]
        if image_rows is not None:  # checked naming the row; the prompt gets its image parts
            row = {k: v[j] for k, v in batch.items()}
            prompt, stored, images = image_rows.check_row(row, ("completion",), where)
        prompt_ids, completion_ids = tokenize_unpaired_row(prompt, batch["completion"][j], tokenizer)
        if image_rows is not None:
            prompt_text, prompt_ids = image_rows.expanded_prompt({**row, "prompt": prompt}, "completion", tokenizer,
                                                                 images, prompt_ids)
        prompt, completion, _ = truncate_pair(prompt_ids, completion_ids, completion_ids, max_length,
                                              max_prompt_length, max_completion_length, truncation_mode)
        if image_rows is not None:
            check_prompt_whole(where, prompt_ids, prompt, bool(images),
                               f"max_length={max_length}, max_prompt_length={max_prompt_length}, "
                               f"truncation_mode='{truncation_mode}'")
            out.setdefault("prompt_text", []).append(prompt_text)
            out.setdefault("images", []).append(stored)
        if not completion:
            raise DataFormatError(
                f"{where}: the prompt has {len(prompt_ids)} tokens and nothing is left of the completion within "
                f"max_length={max_length} (max_prompt_length={max_prompt_length}, truncation_mode='{truncation_mode}'). "
                "Set max_prompt_length below max_length, use truncation_mode='keep_end', or raise max_length."
            )
        out["prompt_input_ids"].append(prompt)
        out["completion_input_ids"].append(completion)
        out["label"].append(bool(batch["label"][j]))
        out["split"].append(split)
        out["index"].append(row_index)
    return out


class UnpairedPreferenceCollator:
    """Rows -> one padded batch: ``input_ids``, ``attention_mask``, ``completion_mask`` (prompt + completion), the
    same three under ``kl_`` for the mismatched sequences (prompt + the partner row's completion, cut to
    ``max_length`` at the end), and ``labels`` (bool, True = desirable). Precomputed ``ref_logps`` /
    ``ref_kl_logps`` pass through when the rows carry them."""

    def __init__(self, pad_token_id: int, max_length: int | None = None, images: PromptImages | None = None) -> None:
        self.pad_token_id, self.max_length, self.images = pad_token_id, max_length, images

    def pad(self, pieces: list[tuple[list[int], list[int]]], prefix: str) -> dict[str, torch.Tensor]:
        seqs = [list(p) + list(c) for p, c in pieces]
        masks = [[0] * len(p) + [1] * len(c) for p, c in pieces]
        if self.max_length is not None:
            seqs, masks = [s[: self.max_length] for s in seqs], [m[: self.max_length] for m in masks]
        longest = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        completion_mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for i, (seq, mask) in enumerate(zip(seqs, masks)):
            input_ids[i, : len(seq)] = torch.tensor(seq)
            attention_mask[i, : len(seq)] = 1
            completion_mask[i, : len(seq)] = torch.tensor(mask)
        return {f"{prefix}input_ids": input_ids, f"{prefix}attention_mask": attention_mask,
                f"{prefix}completion_mask": completion_mask}

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.pad([(r["prompt_input_ids"], r["completion_input_ids"]) for r in rows], "")
        batch.update(self.pad([(r["prompt_input_ids"], r["kl_completion_input_ids"]) for r in rows], "kl_"))
        if self.images is not None:  # a mismatched sequence is its own row's prompt: the same images
            image_inputs, extras = self.images(rows)
            keys = image_inputs.layout.token_keys
            for prefix in ("", "kl_"):
                batch[f"{prefix}image_inputs"] = image_inputs
                pieces = [(e, len(r[f"{prefix}completion_input_ids"])) for e, r in zip(extras, rows)]
                padded = pad_token_extras(pieces, keys, batch[f"{prefix}input_ids"].shape[1], self.max_length)
                batch.update({prefix + key: value for key, value in padded.items()})
        batch["labels"] = torch.tensor([bool(r["label"]) for r in rows], dtype=torch.bool)
        for key in ("ref_logps", "ref_kl_logps"):
            if key in rows[0]:
                batch[key] = torch.tensor([r[key] for r in rows], dtype=torch.float32)
        return batch


class UnpairedPreferenceDataModule(TokenizedDataModule):
    """Batches for KTO: completions judged one at a time, desirable or not.

    Data: unpaired rows ``prompt``, ``completion``, ``label`` (a real boolean: JSON ``true``/``false``, not
    ``"yes"`` or ``1``; CSV cells are text, so use JSONL or parquet), strings or conversations; or paired preference
    rows (``prompt``/``chosen``/``rejected``, or ``chosen``/``rejected`` with the implicit prompt), unpaired on the
    fly as TRL does. Rows are validated before any model loads: a missing or non-boolean label, an empty prompt or
    completion, strings mixed with conversations, or training data without a desirable or without an undesirable
    row is a ``DataFormatError`` naming the row and the column (a validation split may hold one kind: the metrics of
    the other are then not logged).

    Every row also carries a *mismatched* completion, from which KTO estimates its KL term: TRL's construction,
    the completions of each block of ``batch_size`` consecutive rows moved one place down the block
    (``kl_partners``). With ``shuffle: false`` (TRL's sequential order) a micro-batch is exactly one block, so its
    mismatched completions are its own completions; with ``shuffle: true`` (the default here) they come from
    other rows of the data, still never the row's own.

    With a vision-language model, an ``images`` / ``image`` column (TRL's; paired rows give both their rows the
    pair's images) shows each prompt its images, checked and expanded at setup as ``PreferenceDataModule`` does; a
    row's mismatched sequence is its own prompt, so ``kl_image_inputs`` are the row's own images.

    Args:
        path: training data: a local json/jsonl/parquet file or folder, a hub dataset name, or a ``Dataset``.
        tokenizer: a tokenizer or its name/path (the CLI links it to the model's ``model_name_or_path``).
        max_length: prompt + completion tokens per sequence (``None``: no limit; TRL's default 1024).
        max_prompt_length: the prompt keeps its last ``max_prompt_length`` tokens (``None``, the default: no limit;
            TRL 1.16's KTO has no such knob).
        max_completion_length: the completion keeps its first ``max_completion_length`` tokens.
        truncation_mode: ``keep_start`` (default, TRL's) cuts the completion's end; ``keep_end`` drops prompt
            tokens from the start first. A row left without a completion token is an error naming the row (TRL 1.16
            drops it silently).
        **kwargs: the shared arguments of ``TokenizedDataModule`` (``val_path``, ``val_split_size``,
            ``batch_size`` = rows per micro-batch (at least 2 for the ``kto`` loss), ``shuffle``, ``seed``, …).
    """

    def __init__(
        self,
        path: DataSource = None,
        tokenizer: Any = None,
        *,
        max_length: int | None = 1024,
        max_prompt_length: int | None = None,
        max_completion_length: int | None = None,
        truncation_mode: TruncationMode = "keep_start",
        **kwargs: Any,
    ) -> None:
        if truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"truncation_mode='{truncation_mode}' is unknown; use keep_start or keep_end.")
        for key, value in (("max_length", max_length), ("max_prompt_length", max_prompt_length),
                           ("max_completion_length", max_completion_length)):
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1 or null, got {value}.")
        super().__init__(path, tokenizer, **kwargs)
        self.max_length, self.max_prompt_length = max_length, max_prompt_length
        self.max_completion_length, self.truncation_mode = max_completion_length, truncation_mode
        self.reference_logps: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.label_counts: dict[str, tuple[int, int]] = {}  # split -> (desirable, undesirable)

    def default_collator(self) -> Callable:
        images = None
        if self.processor is not None and any("images" in ds.column_names for ds in self.splits().values()):
            images = PromptImages(self.processor, self.image_layout)
        return UnpairedPreferenceCollator(self.tokenizer.pad_token_id, self.max_length, images)

    # ------------------------------------------------------------------------------------- reference log-probs
    def splits(self) -> dict[str, Dataset]:
        """The tokenized splits by label (``train``, ``validation``, ``test``), each dataset once."""
        out = {}
        for label, ds in (("train", self.train_dataset), ("validation", self.val_dataset), ("test", self.test_dataset)):
            if ds is not None and all(ds is not other for other in out.values()):
                out[label] = ds
        return out

    def set_reference_logps(self, label: str, logps: torch.Tensor, kl_logps: torch.Tensor) -> None:
        """Attach precomputed reference log-probs of every row of split ``label`` (its completion and its
        mismatched completion, in row order); collate looks them up by the rows' ``split``/``index``."""
        self.reference_logps[label] = (logps.float().cpu(), kl_logps.float().cpu())

    def collate_fn(self) -> Callable:
        inner = super().collate_fn()
        reference = self.reference_logps

        def collate(rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
            if rows and rows[0].get("split") in reference:
                logps, kl_logps = reference[rows[0]["split"]]
                rows = [dict(r, ref_logps=float(logps[r["index"]]), ref_kl_logps=float(kl_logps[r["index"]]))
                        for r in rows]
            return inner(rows)

        return collate

    # ------------------------------------------------------------------------------------- rows
    def prepare_rows(self, raw: Dataset, tokenizer: Any, label: str) -> Dataset:
        cols = set(raw.column_names)
        if {"chosen", "rejected"} <= cols:
            implicit = "prompt" not in cols
            columns = ["chosen", "rejected"] if implicit else ["prompt", "chosen", "rejected"]
            self.validate_once(raw, self.validation_settings(tokenizer, columns),
                               lambda: self.validate(raw, tokenizer, label, columns))
            rows = unpair_rows(raw, implicit, self.row_numbers)
        elif {"prompt", "completion"} <= cols:
            if "label" not in cols:
                raise DataFormatError(
                    f"Unpaired preference data needs a 'label' column (true = desirable, false = undesirable); the "
                    f"{label} data has {sorted(cols)}. Add a boolean 'label' to every row, or give paired rows "
                    "('prompt', 'chosen', 'rejected'), which are unpaired on the fly."
                )
            self.validate_once(raw, self.validation_settings(tokenizer, ["prompt", "completion"], labelled=True),
                               lambda: self.validate(raw, tokenizer, label, ["prompt", "completion"], labelled=True))
            rows = raw.select_columns(["prompt", "completion", "label"] + image_columns(cols))
            rows = rows.add_column("pair", [-1] * len(rows))
        else:
            detected = detect_format(raw) if {"prompt", "messages", "text", "completion"} & cols else "unknown"
            raise DataFormatError(
                f"Unpaired preference data needs ['prompt', 'completion', 'label'] (or paired ['prompt', 'chosen', "
                f"'rejected'] / ['chosen', 'rejected']); the {label} data has {sorted(cols)}, which looks like "
                f"{detected.replace('_', '-')} data."
            )
        desirable = sum(1 for v in rows["label"][:] if v)
        undesirable = len(rows) - desirable
        if label == "train" and (not desirable or not undesirable):
            raise DataFormatError(
                f"The {label} data has {desirable} desirable (label true) and {undesirable} undesirable (label false) "
                "rows; KTO needs both kinds. Add rows of the missing kind."
            )
        self.label_counts[label] = (desirable, undesirable)
        check_text_model(rows, self.processor, label, self._tokenizer_arg)
        image_rows = None
        if self.processor is not None and image_column(rows.column_names) is not None:
            image_rows = ImageRows(self.processor, self.image_layout, self.image_base_dir)
        tokenized = rows.map(
            _tokenize_batch,
            batched=True,
            with_indices=True,
            remove_columns=rows.column_names,
            num_proc=self.dataset_num_proc,
            desc=f"Tokenizing {label}",
            fn_kwargs=dict(tokenizer=tokenizer, max_length=self.max_length, max_prompt_length=self.max_prompt_length,
                           max_completion_length=self.max_completion_length, truncation_mode=self.truncation_mode,
                           split=label, version=TOKENIZATION_VERSION, image_rows=image_rows),
        )
        completions = tokenized["completion_input_ids"][:]  # a list: a Column reads one row per index
        partners = kl_partners(len(tokenized), self.batch_size)
        return tokenized.add_column("kl_completion_input_ids", [completions[p] for p in partners])

    @staticmethod
    def validation_settings(tokenizer: Any, columns: list[str], labelled: bool = False) -> dict[str, Any]:
        """What ``validate`` reads besides the rows: the key of its cached verdict (``validate_once``)."""
        return {"columns": columns, "labelled": labelled,
                "chat_template": value_hash(getattr(tokenizer, "chat_template", None))}

    def validate(self, raw: Dataset, tokenizer: Any, label: str, columns: list[str], labelled: bool = False) -> None:
        """Every row: strings or conversations throughout, nothing empty, a boolean label."""
        conversational = isinstance(raw[0][columns[0]], list)
        first = self.row_numbers[0] if self.row_numbers else 0
        if conversational:
            check_chat_template(tokenizer, f"{label} unpaired preference data")
        for i, row in iter_rows(raw, columns + (["label"] if labelled else []), self.row_numbers):
            for col in columns:
                validate_field(row[col], i, col, follows=row["prompt"] if col != "prompt" and "prompt" in row else None)
                if isinstance(row[col], list) != conversational:
                    raise DataFormatError(
                        f"row {i}, column '{col}': mixes {'strings' if conversational else 'conversations'} with the "
                        f"{'conversations' if conversational else 'strings'} of row {first}; every row and column must be "
                        "of one kind."
                    )
            if labelled and not isinstance(row["label"], bool):
                got = "no label (null)" if row["label"] is None else f"{type(row['label']).__name__} {row['label']!r:.40}"
                raise DataFormatError(
                    f"row {i}, column 'label': expected a boolean (true = desirable, false = undesirable), got {got}. "
                    "Write JSON true/false (CSV cannot carry booleans: use JSONL or parquet)."
                )

