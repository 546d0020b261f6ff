"""``TriplePreferenceDataModule``: TRL's triple-preference rows (a preference pair plus a gold ``reference``
response) -> validated -> tokenized prompt/chosen/rejected/reference -> triple batches (what ``TPOModule`` trains on).

The pair machinery is ``PreferenceDataModule``'s (prompt extraction, whole-sequence tokenization, truncation,
validation); this adds the third completion. Two layouts, as for pairs: the shared-prompt layout (default; each
triple is one ``[prompt, chosen, rejected, reference]`` segment, the prompt computed once) and the classic padded
layout (chosen rows, rejected rows, then reference rows). Without ``include_reference`` (TPO's ``tpo_alpha = 0``)
the batches hold chosen and rejected only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from lightalign.datamodules.formats import DataFormatError, iter_rows, validate_field
from lightalign.datamodules.preference import (
    TOKENIZATION_VERSION,
    PreferenceCollator,
    PreferenceDataModule,
    extract_prompt,
    tokenize_preference_row,
    truncate_pair,
)
from lightalign.datamodules.shared_prefix import check_pack_length, shared_prefix_batch

if TYPE_CHECKING:
    from datasets import Dataset

REFERENCE = "reference"  # TRL's column of the gold response
TRIPLE = ("chosen", "rejected", REFERENCE)


def extract_triple_prompt(chosen: Any, rejected: Any, reference: Any, row: int) -> tuple[Any, Any, Any, Any]:
    """Implicit prompt of a triple: the one ``extract_prompt`` finds in ``chosen`` and ``rejected``, which
    ``reference`` must start with too (as TRL requires); it is cut off all three."""
    prompt, chosen, rejected = extract_prompt(chosen, rejected, row)
    if type(reference) is not type(prompt) or reference[: len(prompt)] != prompt or len(reference) == len(prompt):
        raise DataFormatError(
            f"row {row}, column '{REFERENCE}': does not continue the implicit prompt that 'chosen' and 'rejected' "
            f"share ({prompt!r:.60}), or leaves nothing after it. Add a 'prompt' column (explicit prompt) or start "
            f"'{REFERENCE}' with the same prompt.")
    return prompt, chosen, rejected, reference[len(prompt):]


def truncate_triple(prompt: list[int], chosen: list[int], rejected: list[int], reference: list[int],
                    max_length: int | None, max_prompt_length: int | None, max_completion_length: int | None,
                    mode: str) -> tuple[list[int], list[int], list[int], list[int]]:
    """``truncate_pair``'s rule for three completions: the prompt is fitted against the longest of the three, then
    every completion is cut to what is left. (``truncate_pair`` fits the prompt against the longer of its two, so
    pairing ``chosen`` with the longer of the others gives the prompt; a second call with that prompt, which then
    already fits, cuts the other two.)"""
    longer = max(rejected, reference, key=len)
    prompt, chosen, _ = truncate_pair(prompt, chosen, longer, max_length, max_prompt_length, max_completion_length,
                                      mode)
    _, rejected, reference = truncate_pair(prompt, rejected, reference, max_length, max_prompt_length,
                                           max_completion_length, mode)
    return prompt, chosen, rejected, reference


def _tokenize_triples(batch: dict[str, list], indices: list[int], tokenizer: Any, implicit: bool,
                      max_length: int | None, max_prompt_length: int | None, max_completion_length: int | None,
                      truncation_mode: str, split: str, row_numbers: list[int] | None = None,
                      version: int = TOKENIZATION_VERSION) -> dict[str, list]:
    out: dict[str, list] = {f"{key}_input_ids": [] for key in ("prompt", *TRIPLE)}
    out.update(split=[], index=[])
    for j, row_index in enumerate(indices):
        row = {k: v[j] for k, v in batch.items()}
        number = row_index if row_numbers is None else row_numbers[row_index]  # the row in the user's data
        if implicit:
            row["prompt"], row["chosen"], row["rejected"], row[REFERENCE] = extract_triple_prompt(
                row["chosen"], row["rejected"], row[REFERENCE], number)
        ids = tokenize_preference_row(row, tokenizer, TRIPLE)
        fitted = truncate_triple(ids["prompt_input_ids"], *(ids[f"{key}_input_ids"] for key in TRIPLE),
                                 max_length, max_prompt_length, max_completion_length, truncation_mode)
        for key, tokens in zip(TRIPLE, fitted[1:]):
            if not tokens:
                raise DataFormatError(
                    f"row {number}, column '{key}': the prompt has {len(ids['prompt_input_ids'])} tokens and nothing "
                    f"is left of this completion within max_length={max_length} (max_prompt_length="
                    f"{max_prompt_length}, truncation_mode='{truncation_mode}'). Set max_prompt_length below "
                    "max_length, use truncation_mode='keep_end', or raise max_length.")
        for key, tokens in zip(("prompt", *TRIPLE), fitted):
            out[f"{key}_input_ids"].append(tokens)
        out["split"].append(split)
        out["index"].append(row_index)
    return out


def _branch_lengths(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, torch.Tensor]:
    return {f"{key}_lengths": torch.tensor([len(r[f"{key}_input_ids"]) for r in rows], dtype=torch.long)
            for key in keys}


class TriplePreferenceCollator(PreferenceCollator):
    """Triples -> one padded batch: the chosen rows, the rejected rows, then (``include_reference``) the reference
    rows (``3B`` rows, or ``2B``), with ``PreferenceCollator``'s tensors and ``chosen_lengths`` /
    ``rejected_lengths`` (/ ``reference_lengths``) per triple."""

    def __init__(self, pad_token_id: int, include_reference: bool = True) -> None:
        self.keys = TRIPLE if include_reference else TRIPLE[:2]
        super().__init__(pad_token_id, self.keys)

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {**super().__call__(rows), **_branch_lengths(rows, self.keys)}


class SharedPromptTripleCollator:
    """Triples -> the shared-prefix layout (``shared_prefix_batch``): one ``[prompt, chosen, rejected, reference]``
    segment per triple (without ``reference`` unless ``include_reference``). Sequence ids: ``i`` is triple ``i``'s
    chosen completion, ``B + i`` its rejected one, ``2B + i`` its reference; plus the ``*_lengths`` per triple."""

    def __init__(self, pad_token_id: int, pack_length: int | None = 2048, include_reference: bool = True) -> None:
        check_pack_length(pack_length)
        self.pad_token_id, self.pack_length = pad_token_id, pack_length
        self.keys = TRIPLE if include_reference else TRIPLE[:2]

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        n = len(rows)
        segments = [(r["prompt_input_ids"], [(k * n + i, r[f"{key}_input_ids"]) for k, key in enumerate(self.keys)])
                    for i, r in enumerate(rows)]
        return {**shared_prefix_batch(segments, self.pad_token_id, self.pack_length),
                **_branch_lengths(rows, self.keys)}


class TriplePreferenceDataModule(PreferenceDataModule):
    """Batches of preference triples from a TRL triple-preference dataset (TRL's ``TPOTrainer`` format).

    Columns: ``prompt`` (optional: without it, the shared beginning of ``chosen`` and ``rejected`` is the prompt,
    and ``reference`` must start with it too), ``chosen``, ``rejected`` and ``reference`` (the gold response);
    plain strings or conversations (chat template applied), one kind throughout. Every row is checked before
    training; a missing, null or empty ``reference`` is an error naming its row and column.

    Args:
        include_reference: put the ``reference`` completions in the batches. Unset (None, the default):
            ``TPOModule`` decides at setup from its ``tpo_alpha`` (0: chosen and rejected only, no forward spent on
            the gold response); set, it must agree with ``tpo_alpha`` (refused otherwise).
        **kwargs: ``PreferenceDataModule``'s (``max_length``, ``max_prompt_length``, ``max_completion_length``,
            ``truncation_mode`` apply to each of the three sequences; ``prompt_sharing``, ``pack_length``;
            ``batch_size`` = triples per micro-batch). ``padding_free`` is not offered for triples.
    """

    def __init__(self, path: Any = None, tokenizer: Any = None, *, include_reference: bool | None = None,
                 **kwargs: Any) -> None:
        if kwargs.get("padding_free"):
            raise ValueError("padding_free is not offered for triples; use prompt_sharing: true (the default: no "
                             "padding between triples) or prompt_sharing: false (padded rows).")
        super().__init__(path, tokenizer, **kwargs)
        self.include_reference = include_reference

    def default_collator(self) -> Callable:
        include = self.include_reference is not False  # unset and no method to decide: every column
        if self.prompt_sharing:
            return SharedPromptTripleCollator(self.tokenizer.pad_token_id, self.pack_length, include)
        return TriplePreferenceCollator(self.tokenizer.pad_token_id, include)

    def prepare_rows(self, raw: Dataset, tokenizer: Any, label: str) -> Dataset:
        cols = raw.column_names
        missing = [c for c in TRIPLE if c not in cols]
        if missing:
            raise DataFormatError(
                f"Triple-preference data needs 'chosen', 'rejected' and '{REFERENCE}' (the gold response) columns; "
                f"the {label} data lacks {missing} (columns found: {sorted(cols)}). Expected ['prompt', 'chosen', "
                f"'rejected', '{REFERENCE}'] (explicit prompt) or ['chosen', 'rejected', '{REFERENCE}'] (implicit).")
        implicit = "prompt" not in cols
        self.validate(raw, tokenizer, label, implicit)
        keep = [c for c in ("prompt", *TRIPLE) if c in cols]
        return raw.select_columns(keep).map(
            _tokenize_triples, batched=True, with_indices=True, remove_columns=keep, num_proc=self.dataset_num_proc,
            desc=f"Tokenizing {label}",
            fn_kwargs=dict(tokenizer=tokenizer, implicit=implicit, max_length=self.max_length,
                           max_prompt_length=self.max_prompt_length, max_completion_length=self.max_completion_length,
                           truncation_mode=self.truncation_mode, split=label, row_numbers=self.row_numbers,
                           version=TOKENIZATION_VERSION),
        )

    def validate(self, raw: Dataset, tokenizer: Any, label: str, implicit: bool) -> None:
        """``PreferenceDataModule``'s checks of the pair, then the ``reference`` of every row: present, not empty,
        of the rows' one kind (strings or conversations)."""
        super().validate(raw, tokenizer, label, implicit)
        conversational = isinstance(raw[0]["chosen"], list)
        columns = ["chosen", REFERENCE] if implicit else ["prompt", REFERENCE]
        for i, row in iter_rows(raw, columns, self.row_numbers):
            value = row[REFERENCE]
            validate_field(value, i, REFERENCE, follows=None if implicit else row["prompt"])
            if isinstance(value, list) != conversational:
                raise DataFormatError(
                    f"row {i}, column '{REFERENCE}': {'a string' if conversational else 'a conversation'} among "
                    f"{'conversations' if conversational else 'strings'}; every row and column must be of one kind.")
