"""``PreferenceDataModule``: TRL preference rows -> validated -> tokenized prompt/chosen/rejected -> pair batches."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import torch

from lightalign.datamodules.base import TokenizedDataModule
from lightalign.datamodules.sources import DataSource
from lightalign.datamodules.shared_prefix import SharedPromptCollator, check_pack_length
from lightalign.vision.inputs import ImageInputs
from lightalign.vision.images import image_column
from lightalign.datamodules.image_rows import (ImageRows, PromptImages, check_prompt_whole, check_text_model,
                                               image_columns, pad_token_extras)
from lightalign.datamodules.formats import (
    DataFormatError,
    check_chat_template,
    detect_format,
    is_conversation,
    iter_rows,
    render_prompt_completion,
    validate_field,
)

if TYPE_CHECKING:  # datasets (with pandas, pyarrow) is imported where rows are read, not for --help
    from datasets import Dataset

TruncationMode = Literal["keep_start", "keep_end"]
COMPLETIONS = ("chosen", "rejected")
MARGIN = "margin"  # optional per-row column: the reward margin chosen must beat rejected by (RewardModule)
# Part of the datasets cache fingerprint of tokenized rows: bump it whenever tokenization changes its output, so
# caches written by an older lightalign are not reused.
# 4: tool-call arguments given as a JSON string are rendered as the object (``formats.chat_messages``).
TOKENIZATION_VERSION = 4


def extract_prompt(chosen: Any, rejected: Any, row: int) -> tuple[Any, Any, Any]:
    """Implicit prompt: the shared beginning of ``chosen`` and ``rejected`` is the prompt.

    The prompt is the longest common prefix (of messages, or of characters) that leaves both completions
    non-empty (``"x\\n1"`` / ``"x\\n11"`` gives ``"x\\n"``, ``"1"``, ``"11"``, as TRL does), and a trailing
    space of the prefix goes to the completions, so they start with it like the explicit-prompt convention.
    The split is in characters; ``tokenize_preference_row`` then moves it to a token boundary.
    """
    longest = min(len(chosen), len(rejected)) - 1  # the prompt must leave a message or character in each completion
    i = 0
    while i < longest and chosen[i] == rejected[i]:
        i += 1
    if isinstance(chosen, list):
        if i == 0:
            raise DataFormatError(
                f"row {row}: implicit-prompt conversations in 'chosen' and 'rejected' share no leading message that "
                "leaves both a completion, so there is no prompt. Add a 'prompt' column or start both with the same "
                "user turn."
            )
        return chosen[:i], chosen[i:], rejected[i:]
    if i > 0 and chosen[i - 1] == " ":
        i -= 1
    if i == 0:
        raise DataFormatError(
            f"row {row}: 'chosen' and 'rejected' share no prefix that leaves both non-empty, so the implicit prompt "
            f"is empty (chosen {chosen!r:.60}, rejected {rejected!r:.60}). Add a 'prompt' column (explicit prompt) "
            "or make both start with the prompt text."
        )
    return chosen[:i], chosen[i:], rejected[i:]


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    """How many leading tokens ``ids`` and ``other`` share."""
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


def tokenize_preference_row(row: dict[str, Any], tokenizer: Any,
                            completions: Sequence[str] = COMPLETIONS) -> dict[str, list[int]]:
    """Prompt and completions -> token ids (before truncation).

    ``prompt + chosen`` and ``prompt + rejected`` are tokenized as whole texts, so every sequence is the
    tokenizer's own output (tokenizing the parts apart can split a word the split point cuts, ``"Th" + "e"``).
    The prompt is the tokenized prompt up to where it stops being a prefix of both whole sequences, and each
    completion is the rest of its sequence, as TRL does. As TRL does, EOS ends each completion of standard
    (string) rows unless it is already there; conversational completions end where the chat template closes the
    assistant turn. ``completions``: the columns tokenized after the prompt (a triple adds ``reference``).
    """
    prompt = row["prompt"]
    wholes: dict[str, list[int]] = {}
    if is_conversation(prompt):
        prompt_text = None
        for key in completions:
            prompt_text, completion_text = render_prompt_completion(tokenizer, prompt, row[key])
            wholes[key] = tokenizer(prompt_text + completion_text, add_special_tokens=False)["input_ids"]
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        eos = tokenizer.eos_token_id
        for key in completions:
            ids = tokenizer(prompt + row[key], add_special_tokens=True)["input_ids"]
            wholes[key] = ids + [eos] if eos is not None and ids[-1:] != [eos] else ids
    split = min(common_prefix_length(prompt_ids, wholes[key]) for key in completions)
    out = {"prompt_input_ids": prompt_ids[:split]}
    for key in completions:
        out[f"{key}_input_ids"] = wholes[key][split:]
    return out


def truncate_pair(
    prompt: list[int],
    chosen: list[int],
    rejected: list[int],
    max_length: int | None,
    max_prompt_length: int | None,
    max_completion_length: int | None,
    mode: str,
) -> tuple[list[int], list[int], list[int]]:
    """Fit a tokenized pair to the length limits.

    The prompt keeps its last ``max_prompt_length`` tokens, each completion its first ``max_completion_length``.
    Then prompt + completion must fit ``max_length``: ``keep_start`` (the default) keeps the sequence's start,
    cutting the completions' ends (the prompt too if it alone passes ``max_length``); ``keep_end`` drops prompt
    tokens from the start (keeping at least one) and only then cuts the completions' ends.

    Differences from TRL 1.16, which has no ``max_prompt_length`` and truncates each whole prompt+completion
    sequence: ``keep_start`` gives TRL's sequences whenever the prompt fits ``max_prompt_length``; TRL's
    ``keep_end`` (deprecated there) keeps the last ``max_length`` tokens, which can cut a completion's start,
    while ours keeps both completions' starts and the end of the prompt.
    """
    if max_prompt_length is not None:
        prompt = prompt[-max_prompt_length:]
    if max_completion_length is not None:
        chosen, rejected = chosen[:max_completion_length], rejected[:max_completion_length]
    if max_length is not None:
        if mode == "keep_end":
            longest = max(len(chosen), len(rejected))
            keep = min(len(prompt), max(1, max_length - longest))
            prompt = prompt[len(prompt) - keep :]
        else:
            prompt = prompt[:max_length]
        budget = max(0, max_length - len(prompt))
        chosen, rejected = chosen[:budget], rejected[:budget]
    return prompt, chosen, rejected


def parse_margin(value: Any, row: int) -> float:
    """A row's ``margin`` as a float: a number, or a numeric string (CSV cells are text); anything else, or a
    NaN/inf, is an error naming the row."""
    import math

    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        raise DataFormatError(
            f"row {row}, column '{MARGIN}': {value!r} is not a finite number. The optional '{MARGIN}' column gives "
            "each pair the reward margin chosen must beat rejected by (e.g. 0.5); give every row a number, or drop "
            "the column."
        )
    return number


def _tokenize_batch(batch: dict[str, list], indices: list[int], tokenizer: Any, implicit: bool,
                    max_length: int | None, max_prompt_length: int | None, max_completion_length: int | None,
                    truncation_mode: str, split: str, row_numbers: list[int] | None = None,
                    version: int = TOKENIZATION_VERSION, image_rows: ImageRows | None = None) -> dict[str, list]:
    out: dict[str, list] = {"prompt_input_ids": [], "chosen_input_ids": [], "rejected_input_ids": [], "split": [],
                            "index": []}
    for j, row_index in enumerate(indices):
        row = {k: v[j] for k, v in batch.items()}
        number = row_index if row_numbers is None else row_numbers[row_index]  # the row in the user's data
        if implicit:
            row["prompt"], row["chosen"], row["rejected"] = extract_prompt(row["chosen"], row["rejected"], number)
        if image_rows is not None:  # checked naming the row; the prompt gets its image parts
            row["prompt"], stored, images = image_rows.check_row(row, COMPLETIONS, f"row {number}")
        ids = tokenize_preference_row(row, tokenizer)
        if image_rows is not None:
            prompt_text, ids["prompt_input_ids"] = image_rows.expanded_prompt(row, "chosen", tokenizer, images,
                                                                              ids["prompt_input_ids"])
        prompt, chosen, rejected = truncate_pair(
            ids["prompt_input_ids"], ids["chosen_input_ids"], ids["rejected_input_ids"],
            max_length, max_prompt_length, max_completion_length, truncation_mode,
        )
        if image_rows is not None:
            check_prompt_whole(f"row {number}", ids["prompt_input_ids"], prompt, bool(images),
                               f"max_length={max_length}, max_prompt_length={max_prompt_length}, "
                               f"truncation_mode='{truncation_mode}'")
            out.setdefault("prompt_text", []).append(prompt_text)
            out.setdefault("images", []).append(stored)
        if not chosen or not rejected:
            raise DataFormatError(
                f"row {number}: the prompt has {len(ids['prompt_input_ids'])} tokens and nothing is left of the "
                f"{'chosen' if not chosen else 'rejected'} completion within max_length={max_length} "
                f"(max_prompt_length={max_prompt_length}, truncation_mode='{truncation_mode}'). Set "
                "max_prompt_length below max_length (the prompt then keeps its end), use truncation_mode='keep_end', "
                "or raise max_length."
            )
        out["prompt_input_ids"].append(prompt)
        out["chosen_input_ids"].append(chosen)
        out["rejected_input_ids"].append(rejected)
        out["split"].append(split)
        out["index"].append(row_index)
        if MARGIN in row:
            out.setdefault(MARGIN, []).append(parse_margin(row[MARGIN], row_index))
    return out


class PreferenceCollator:
    """Pairs -> one padded batch with the chosen sequences first and the rejected ones after (``2B`` rows).

    Returns ``input_ids``, ``attention_mask`` and ``completion_mask`` (1 on completion tokens), and passes
    precomputed ``ref_chosen_logps`` / ``ref_rejected_logps`` and the rows' ``margin`` (``[B]``) through when the
    rows carry them. ``completions``: the row blocks, in order (a triple batch adds ``reference``).
    """

    def __init__(self, pad_token_id: int, completions: Sequence[str] = COMPLETIONS,
                 images: PromptImages | None = None) -> None:
        self.pad_token_id, self.completions, self.images = pad_token_id, tuple(completions), images

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seqs, masks, extras = [], [], []
        image_inputs, prompt_extras = self.images(rows) if self.images is not None else (None, None)
        for key in self.completions:
            for i, row in enumerate(rows):
                prompt, completion = row["prompt_input_ids"], row[f"{key}_input_ids"]
                seqs.append(list(prompt) + list(completion))
                masks.append([0] * len(prompt) + [1] * len(completion))
                if prompt_extras is not None:
                    extras.append((prompt_extras[i], len(completion)))
        longest = max(len(s) for s in seqs)
        n = len(seqs)
        input_ids = torch.full((n, longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((n, longest), dtype=torch.long)
        completion_mask = torch.zeros((n, longest), dtype=torch.long)
        for i, (seq, mask) in enumerate(zip(seqs, masks)):
            input_ids[i, : len(seq)] = torch.tensor(seq)
            attention_mask[i, : len(seq)] = 1
            completion_mask[i, : len(seq)] = torch.tensor(mask)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask}
        if image_inputs is not None:  # each prompt's images once per block (chosen rows, then rejected rows)
            batch["image_inputs"] = ImageInputs.cat([image_inputs] * len(self.completions))
            batch.update(pad_token_extras(extras, image_inputs.layout.token_keys, longest))
        for key in ("ref_chosen_logps", "ref_rejected_logps", MARGIN):
            if key in rows[0]:
                batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
        return batch


class PaddingFreePreferenceCollator:
    """Pairs -> one row ``[1, total]``: the chosen sequences, then the rejected ones, back to back (no padding).

    Returns ``input_ids``, ``position_ids`` (restarting at 0 with each sequence), ``completion_mask`` (0 on the
    first token of every sequence, which nothing in its own sequence predicts) and ``sequence_sizes`` (host
    integers), and passes precomputed reference log-probs through, like ``PreferenceCollator``.
    """

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        ids: list[int] = []
        positions: list[int] = []
        completion: list[int] = []
        sizes: list[int] = []
        for key in COMPLETIONS:
            for row in rows:
                prompt, answer = list(row["prompt_input_ids"]), list(row[f"{key}_input_ids"])
                ids.extend(prompt + answer)
                positions.extend(range(len(prompt) + len(answer)))
                completion.extend(([0] * len(prompt) + [1] * len(answer)))
                completion[len(ids) - len(prompt) - len(answer)] = 0
                sizes.append(len(prompt) + len(answer))
        as_row = lambda xs: torch.tensor(xs, dtype=torch.long).unsqueeze(0)  # noqa: E731
        batch: dict[str, Any] = {"input_ids": as_row(ids), "position_ids": as_row(positions),
                                 "completion_mask": as_row(completion), "sequence_sizes": sizes}
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in rows[0]:
                batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
        return batch


class PreferenceDataModule(TokenizedDataModule):
    """Batches of preference pairs from any TRL preference dataset.

    Explicit prompt (``prompt``, ``chosen``, ``rejected``) or implicit prompt (``chosen``, ``rejected``: their
    shared beginning is the prompt); plain strings or conversations (chat template applied). An optional numeric
    ``margin`` column (per pair, as TRL's reward data has) reaches the batches as ``margin``; ``RewardModule``
    reads it, the other methods ignore it.

    With a vision-language model, an ``images`` / ``image`` column (TRL's) shows each pair's prompt its images:
    rows checked and prompts expanded at setup (``ImageRows``; an image row's prompt is kept whole, a row that
    would need a cut is refused naming it), each prompt processed with its images in the collator
    (``PromptImages``: ``batch["image_inputs"]`` for the chosen rows and again for the rejected rows, and the
    token-aligned extras). ``prompt_sharing`` and ``padding_free`` are refused with image rows.

    Args:
        path: training data: a local json/jsonl/parquet/csv file or folder, a hub dataset name, or a ``Dataset``.
        tokenizer: a tokenizer or its name/path (the CLI links it to the model's ``model_name_or_path``).
        max_length: prompt + completion tokens per sequence (``None``: no limit).
        max_prompt_length: the prompt keeps its last ``max_prompt_length`` tokens (``None``: no limit).
        max_completion_length: each completion keeps its first ``max_completion_length`` tokens.
        truncation_mode: how prompt + completion is fitted to ``max_length``: ``keep_start`` (default, as in
            TRL 1.16) cuts the completions' ends, so every kept token sees its whole prompt (capped by
            ``max_prompt_length``); ``keep_end`` drops prompt tokens from the start first and cuts the completions
            only when one token of prompt is left (whole completions, but a context the model does not see at
            inference). A row left without a completion token is an error naming the row (TRL drops it).
            Unlike TRL 1.16 (no ``max_prompt_length``; its deprecated ``keep_end`` keeps the last ``max_length``
            tokens of each sequence) the prompt is capped first, and ``keep_end`` never cuts a completion's start.
        prompt_sharing: batch each pair as one ``[prompt, chosen, rejected]`` segment so the prompt is computed
            once (``SharedPromptCollator``; same log-probs as the classic layout, fewer tokens, no padding but
            each row's tail). Needs an attention implementation that takes a 4D mask (``sdpa``, ``eager``);
            ``False`` gives the classic padded chosen-then-rejected rows (``PreferenceCollator``).
        pack_length: with ``prompt_sharing``, a micro-batch of ``T`` tokens is split into
            ``ceil(T / pack_length)`` rows of balanced length, padded to the widest; ``None`` puts all pairs in
            one row, without padding, under a ``[T, T]`` mask. With ``sdpa`` (the default; run as
            ``sdpa_varlen``) each pair attends on its own, so attention does not grow with the row; with
            ``eager`` attention a row costs the square of its length (use about 512 there). Large rows are faster and
            smaller at their peak than rows of 512 tokens (measured on long-tailed pairs, see docs/performance.md
            'DPO with balanced rows').
        padding_free: with ``prompt_sharing: false``, put the micro-batch's chosen and rejected sequences one after
            another in a single row (``PaddingFreePreferenceCollator``): no pad token is computed, positions
            restart with each sequence and attention stays inside it (``sdpa_varlen``, or the model's own
            position-id masks); the same log-probs as the padded rows. Refused at fit start for models that
            cannot pack (``adaptations.check_layout``). (TRL 1.16 has the knob but turns it off.)
        **kwargs: the shared arguments of ``TokenizedDataModule`` (``val_path``, ``batch_size`` = pairs per
            micro-batch, ``collator``, ``shuffle``, ``seed``, …).
    """

    def __init__(
        self,
        path: DataSource = None,
        tokenizer: Any = None,
        *,
        max_length: int | None = 1024,
        max_prompt_length: int | None = 512,
        max_completion_length: int | None = None,
        truncation_mode: TruncationMode = "keep_start",
        prompt_sharing: bool = True,
        pack_length: int | None = 2048,
        padding_free: bool = False,
        **kwargs: Any,
    ) -> None:
        if padding_free and prompt_sharing:
            raise ValueError("padding_free=True packs the classic chosen/rejected rows; set prompt_sharing: false with "
                             "it (the shared-prompt layout already has no padding between pairs).")
        if truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"truncation_mode='{truncation_mode}' is unknown; use keep_start or keep_end.")
        for key, value in (("max_length", max_length), ("max_prompt_length", max_prompt_length),
                           ("max_completion_length", max_completion_length)):
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1 or null, got {value}.")
        check_pack_length(pack_length)
        super().__init__(path, tokenizer, **kwargs)
        self.prompt_sharing, self.pack_length, self.padding_free = prompt_sharing, pack_length, padding_free
        self.max_length, self.max_prompt_length = max_length, max_prompt_length
        self.max_completion_length, self.truncation_mode = max_completion_length, truncation_mode
        self.reference_logps: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def default_collator(self) -> Callable:
        if self.prompt_sharing:
            return SharedPromptCollator(self.tokenizer.pad_token_id, self.pack_length)
        if self.padding_free:
            return PaddingFreePreferenceCollator()
        return PreferenceCollator(self.tokenizer.pad_token_id, images=self.prompt_images())

    def prompt_images(self) -> PromptImages | None:
        """The collator part that processes each prompt with its images; None unless the rows carry images."""
        if self.processor is None or not any("images" in ds.column_names for ds in self.splits().values()):
            return None
        return PromptImages(self.processor, self.image_layout)

    # ------------------------------------------------------------------------------------- reference log-probs
    def splits(self) -> dict[str, Dataset]:
        """The tokenized splits by label (``train``, ``validation``, ``test``), each dataset once."""
        out = {}
        for label, ds in (("train", self.train_dataset), ("validation", self.val_dataset), ("test", self.test_dataset)):
            if ds is not None and all(ds is not other for other in out.values()):
                out[label] = ds
        return out

    def set_reference_logps(self, label: str, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        """Attach precomputed reference log-probs (one per row of split ``label``, in row order) to its batches.

        They are looked up by the rows' ``split``/``index`` columns at collate time, so loaders built earlier
        (and DataLoader workers started later) see them too.
        """
        self.reference_logps[label] = (chosen.float().cpu(), rejected.float().cpu())

    def collate_fn(self) -> Callable:
        inner = super().collate_fn()
        reference = self.reference_logps

        def collate(rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
            if rows and rows[0].get("split") in reference:
                chosen, rejected = reference[rows[0]["split"]]
                rows = [dict(r, ref_chosen_logps=float(chosen[r["index"]]), ref_rejected_logps=float(rejected[r["index"]]))
                        for r in rows]
            return inner(rows)

        return collate

    def prepare_rows(self, raw: Dataset, tokenizer: Any, label: str) -> Dataset:
        cols = raw.column_names
        if not {"chosen", "rejected"} <= set(cols):
            missing = [c for c in COMPLETIONS if c not in cols]
            detected = detect_format(raw) if {"prompt", "messages", "text"} & set(cols) else "unknown"
            raise DataFormatError(
                f"Preference data needs 'chosen' and 'rejected' columns; the {label} data lacks {missing} "
                f"(columns found: {sorted(cols)}, which look like {detected.replace('_', '-')} data). "
                "Expected ['prompt', 'chosen', 'rejected'] (explicit prompt) or ['chosen', 'rejected'] (implicit)."
            )
        implicit = "prompt" not in cols
        self.validate(raw, tokenizer, label, implicit)
        keep = [c for c in ("prompt", "chosen", "rejected") if c in cols]
        margin = [MARGIN] if MARGIN in cols else []  # checked and made a float per row in _tokenize_batch
        image_rows = self.image_rows(raw, label)
        if image_rows is not None:
            keep += image_columns(cols)
        return raw.select_columns(keep + margin).map(
            _tokenize_batch,
            batched=True,
            with_indices=True,
            remove_columns=keep,
            num_proc=self.dataset_num_proc,
            desc=f"Tokenizing {label}",
            fn_kwargs=dict(
                tokenizer=tokenizer,
                implicit=implicit,
                max_length=self.max_length,
                max_prompt_length=self.max_prompt_length,
                max_completion_length=self.max_completion_length,
                truncation_mode=self.truncation_mode,
                split=label,
                row_numbers=self.row_numbers,
                version=TOKENIZATION_VERSION,
                image_rows=image_rows,
            ),
        )

    def image_rows(self, raw: Dataset, label: str) -> ImageRows | None:
        """For data with an image column and a vision-language model: what checks and tokenizes its rows
        (``ImageRows``). A layout other than padded pairs with images is refused at the module's setup, measured on the
        model (``PolicyModule.refuse_unmeasured_images``)."""
        check_text_model(raw, self.processor, label, self._tokenizer_arg)
        if self.processor is None or image_column(raw.column_names) is None:
            return None
        return ImageRows(self.processor, self.image_layout, self.image_base_dir)

    def validate(self, raw: Dataset, tokenizer: Any, label: str, implicit: bool) -> None:
        """Every row: strings or conversations throughout, nothing empty; count identical pairs."""
        columns = list(COMPLETIONS) if implicit else ["prompt", *COMPLETIONS]
        first, first_number = raw[0], self.row_numbers[0] if self.row_numbers else 0
        conversational = isinstance(first[columns[0]], list)
        if conversational:
            check_chat_template(tokenizer, f"{label} preference data")
        identical, first_identical = 0, None
        for i, row in iter_rows(raw, columns, self.row_numbers):
            for col in columns:
                validate_field(row[col], i, col, follows=row["prompt"] if col in COMPLETIONS and not implicit else None)
                if isinstance(row[col], list) != conversational:
                    raise DataFormatError(
                        f"row {i}, column '{col}': mixes {'strings' if conversational else 'conversations'} with the "
                        f"{'conversations' if conversational else 'strings'} of row {first_number}; every row and column must be "
                        "of one kind."
                    )
            if row["chosen"] == row["rejected"]:
                identical += 1
                first_identical = i if first_identical is None else first_identical
        if identical and identical == len(raw):
            raise DataFormatError(
                f"Every one of the {identical} {label} rows has identical 'chosen' and 'rejected' (the first: row "
                f"{first_identical}): there is no preference to learn (zero gradient for most losses). Check that the "
                "columns hold the preferred and the dispreferred answer.")
        if identical:
            warnings.warn(
                f"{identical} of {len(raw)} {label} rows have identical 'chosen' and 'rejected' (the first: row "
                f"{first_identical}); they carry no preference signal (zero gradient for most losses).",
                stacklevel=2,
            )
