"""``PromptDataModule``: prompt-only rows (plus any columns for reward functions) -> rollout batches for GRPO."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch.utils.data import DataLoader

from lightalign.datamodules.base import TokenizedDataModule
from lightalign.datamodules.check_verdicts import value_hash
from lightalign.datamodules.sources import DataSource
from lightalign.datamodules.index_samplers import RepeatBatchSampler
from lightalign.datamodules.step_loader import SeededLoader
from lightalign.datamodules.formats import (DataFormatError, MissingColumnError, about_row, chat_messages,
                                            check_chat_template, iter_rows, validate_field)

if TYPE_CHECKING:  # datasets (with pandas, pyarrow) is imported where rows are read, not for --help
    from datasets import Dataset


# Part of the datasets cache fingerprint of tokenized prompts (datasets hashes a module's function by its name, not
# its code): bump it whenever tokenization changes its output, so caches written by an older lightalign are not reused.
# 1: tool-call arguments given as a JSON string are rendered as the object (``formats.chat_messages``).
TOKENIZATION_VERSION = 1
OWNED_CHAT_TEMPLATE_KEYS = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message",
                            "return_dict", "chat_template")


def _tokenize_prompts(batch: dict[str, list], tokenizer: Any, max_prompt_length: int | None,
                      chat_template_kwargs: dict[str, Any] | None = None, version: int = TOKENIZATION_VERSION,
                      ) -> dict[str, list]:
    ids_out = []
    for prompt in batch["prompt"]:
        if isinstance(prompt, list):
            text = tokenizer.apply_chat_template(chat_messages(prompt), tokenize=False, add_generation_prompt=True,
                                                 **(chat_template_kwargs or {}))
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if max_prompt_length is not None:
            ids = ids[-max_prompt_length:]  # left truncation: the end of the prompt is what the model continues
        ids_out.append(ids)
    return {"prompt_input_ids": ids_out}


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int, device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids left-padded into ``(ids, mask)`` ``[rows, longest]``: generation continues at the right edge."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            ids[i, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


class PromptCollator:
    """Left-pads prompt ids (generation continues at the right edge) and passes raw prompts and columns through.

    Returns ``prompt_input_ids``, ``prompt_attention_mask``, ``prompts`` (strings or message lists, as in the
    data, tool-call arguments as objects: ``formats.chat_messages``, so that every later rendering of a prompt with
    its turns, in a tool rollout or a reward model, is the one the prompt ids were tokenized from) and ``columns``
    (every other column as a list, for the reward functions).
    """

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        ids, mask = left_pad([r["prompt_input_ids"] for r in rows], self.pad_token_id)
        extra = [k for k in rows[0] if k not in ("prompt", "prompt_input_ids")]
        return {
            "prompt_input_ids": ids,
            "prompt_attention_mask": mask,
            "prompts": [chat_messages(r["prompt"]) if isinstance(r["prompt"], list) else r["prompt"] for r in rows],
            "columns": {k: [r[k] for r in rows] for k in extra},
        }


class PromptDataModule(TokenizedDataModule):
    """Prompts for online RL (GRPO) from any TRL prompt-only dataset.

    ``prompt`` is a string or a conversation (the chat template is applied with the generation prompt); every
    other column (e.g. ``answer``) is kept and reaches the reward functions as a keyword list. For a
    vision-language model, an ``images`` (or ``image``) column gives each prompt its images (TRL's format; rows
    checked and batched by ``image_prompts``: ``prepare_image_prompts``, ``ImagePromptCollator``). The number of
    prompts per training batch is set by the module (``generation_batch_size / num_generations``) through
    ``configure_rollout``; ``batch_size`` applies to validation (``val_batch_size``).

    Args:
        path: training prompts: a local json/jsonl/parquet/csv file or folder, a hub dataset name, or a ``Dataset``.
        tokenizer: a tokenizer or its name/path (the CLI links it to the model's ``model_name_or_path``).
        max_prompt_length: prompts keep their last ``max_prompt_length`` tokens (left truncation).
        chat_template_kwargs: extra variables for the chat template of conversational prompts (e.g.
            ``{"enable_thinking": false}``), passed to ``apply_chat_template`` (TRL's GRPO knob of that name).
        **kwargs: the shared arguments of ``TokenizedDataModule`` (``val_path``, ``val_split_size``, ``seed`` …).
    """

    def __init__(self, path: DataSource = None, tokenizer: Any = None, *,
                 max_prompt_length: int | None = 512, chat_template_kwargs: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or null, got {max_prompt_length}.")
        if chat_template_kwargs is not None:
            if not isinstance(chat_template_kwargs, dict):
                raise ValueError(f"chat_template_kwargs must be a mapping of template variables, got "
                                 f"{type(chat_template_kwargs).__name__}.")
            owned = sorted(set(chat_template_kwargs) & set(OWNED_CHAT_TEMPLATE_KEYS))
            if owned:
                raise ValueError(f"chat_template_kwargs sets {owned}, which the prompt data sets itself (a prompt "
                                 "ends with the generation prompt; the template is data.chat_template).")
        self.chat_template_kwargs = chat_template_kwargs
        super().__init__(path, tokenizer, **kwargs)
        self.max_prompt_length = max_prompt_length
        self.prompts_per_generation = self.batch_size
        self.repeat = 1
        self.conversation_rows: dict[str, int] = {}  # split label -> rows split from a 'messages' column
        self.image_rows: dict[str, int] = {}  # split label -> rows with images (a vision-language model's data)
        self.image_column: str | None = None  # the data's image column ('images' or 'image'), once one is seen

    def configure_rollout(self, prompts_per_generation: int, repeat: int) -> None:
        """Called by the GRPO module: prompts per generation batch, and training steps each rollout serves."""
        self.prompts_per_generation, self.repeat = prompts_per_generation, repeat

    def default_collator(self) -> Callable:
        if self.processor is not None:  # a vision-language model: each row through the processor (its images)
            from lightalign.datamodules.image_prompts import ImagePromptCollator

            return ImagePromptCollator(self.processor, self.image_layout, self.image_column, left_pad)
        return PromptCollator(self.tokenizer.pad_token_id)

    @property
    def has_images(self) -> bool:
        """Whether any prepared split has a row with an image (the online methods refuse, at setup, what they
        cannot run exactly with images: ``check_image_rollout``)."""
        return any(self.image_rows.values())

    def rollouts_per_epoch(self) -> int:
        """Generation batches one epoch of this rank's prompts holds (an incomplete last one is dropped)."""
        per_epoch = len(self.make_epoch_sampler()) // self.prompts_per_generation
        if per_epoch < 1:
            raise DataFormatError(f"The training data has {len(self.make_epoch_sampler())} prompts per rank, fewer "
                                  f"than one generation batch needs ({self.prompts_per_generation}).")
        return per_epoch

    def rollout_index(self, epoch: int, batch_idx: int) -> int:
        """The index (from the first epoch's start) of the rollout whose prompts the training loader hands out as
        batch ``batch_idx`` of ``epoch`` (each rollout's batch is handed out ``repeat`` times in a row)."""
        return epoch * self.rollouts_per_epoch() + batch_idx // self.repeat

    def rollout_prompts(self, index: int) -> dict[str, Any]:
        """The prompt batch of this rank's rollout ``index`` (counted from the run's start, over epochs): the
        batch the training loader hands to that rollout's first step, computed without iterating the loader (the
        order is a pure function of seed, epoch and rank), so a sampler can start on it ahead of the training loop
        (``max_staleness``)."""
        epoch, position = divmod(index, self.rollouts_per_epoch())
        order_of = self.make_epoch_sampler()
        order_of.set_epoch(epoch)
        start = position * self.prompts_per_generation
        rows = order_of.order()[start:start + self.prompts_per_generation]
        return self.collate_fn()([self.train_dataset[i] for i in rows])

    def prepare_rows(self, raw: Dataset, tokenizer: Any, label: str) -> Dataset:
        if "prompt" not in raw.column_names and "messages" in raw.column_names:
            raw = split_conversations(raw, label, self.row_numbers)
            self.conversation_rows[label] = len(raw)
        if "prompt" not in raw.column_names:
            raise DataFormatError(
                f"Prompt data needs a 'prompt' column; the {label} data has {sorted(raw.column_names)}. "
                "Rename the column holding the prompts to 'prompt' (strings or message lists)."
            )
        if self.processor is not None:  # a vision-language model's prompts, with or without images
            return self.prepare_image_rows(raw, label)
        from lightalign.vision.images import image_column

        column = image_column(raw.column_names)
        if column is not None:
            raise DataFormatError(
                f"The {label} data has an '{column}' column, and '{self._tokenizer_arg}' is a text model, which "
                "cannot read images: use a vision-language model (its processor reads the images), or drop the "
                "column.")
        self.validate_once(raw, {"chat_template": value_hash(getattr(tokenizer, "chat_template", None))},
                           lambda: self.validate(raw, tokenizer, label))
        return raw.map(_tokenize_prompts, batched=True, num_proc=self.dataset_num_proc, desc=f"Tokenizing {label}",
                       fn_kwargs=dict(tokenizer=tokenizer, max_prompt_length=self.max_prompt_length,
                                      chat_template_kwargs=self.chat_template_kwargs, version=TOKENIZATION_VERSION))

    def validate(self, raw: Dataset, tokenizer: Any, label: str) -> None:
        """Every prompt: a string or a conversation throughout, nothing empty (a conversation needs a chat
        template)."""
        conversational = isinstance(raw[0]["prompt"], list)
        first = self.row_numbers[0] if self.row_numbers else 0
        if conversational:
            check_chat_template(tokenizer, f"{label} prompts")
        for i, row in iter_rows(raw, ["prompt"], self.row_numbers):
            validate_field(row["prompt"], i, "prompt")
            if isinstance(row["prompt"], list) != conversational:
                raise DataFormatError(f"row {i}, column 'prompt': mixes strings and conversations (row {first} is "
                                      f"{'a conversation' if conversational else 'a string'}).")

    def prepare_image_rows(self, raw: Dataset, label: str) -> Dataset:
        """A vision-language model's prompts: each row checked (its images open, its placeholders count them) and
        tokenized by the processor; the images kept as refs (``prepare_image_prompts``)."""
        from lightalign.datamodules.image_prompts import prepare_image_prompts
        from lightalign.vision.images import image_column

        column = image_column(raw.column_names)
        if column is not None:
            self.image_column = self.image_column or column
        prepared = prepare_image_prompts(
            raw, self.processor, self.image_layout, label=label, numbers=self.row_numbers,
            base_dir=self.image_base_dir, max_prompt_length=self.max_prompt_length,
            chat_template_kwargs=self.chat_template_kwargs)
        self.image_rows[label] = sum(1 for refs in prepared["image_refs"] if refs)
        return prepared

    def train_dataloader(self) -> DataLoader:
        if len(self.train_dataset) < self.prompts_per_generation:
            raise DataFormatError(
                f"The training data has {len(self.train_dataset)} prompts, fewer than one generation batch needs "
                f"({self.prompts_per_generation} = generation_batch_size / num_generations). Add prompts or lower "
                "generation_batch_size."
            )
        sampler = RepeatBatchSampler(self.make_epoch_sampler(), self.prompts_per_generation, self.repeat)
        self.use_train_sampler(sampler)
        loader = SeededLoader(self.train_dataset, batch_sampler=sampler, collate_fn=self.collate_fn(),
                              num_workers=self.num_workers, seed=self.seed)
        # Expose the rank-aware EpochSampler (a DistributedSampler) so Lightning's DDP/FSDP/DeepSpeed see the
        # loader is already sharded; otherwise they try to inject a sampler into the batch sampler and fail.
        object.__setattr__(loader, "sampler", sampler.sampler)
        return loader


def split_conversations(raw: Dataset, label: str, numbers: Any = None) -> Dataset:
    """TRL's conversational language-modeling rows (a ``messages`` column, as its GKD trainer reads them) as
    prompt-completion rows: the conversation before its last message is the prompt, that message (the assistant's)
    the completion."""
    if "completion" in raw.column_names:
        raise DataFormatError(f"The {label} data has both 'messages' and 'completion' columns: give either "
                              "conversations ('messages') or prompt-completion rows ('prompt', 'completion').")
    for position, (i, row) in enumerate(iter_rows(raw, ["messages"], numbers)):
        messages = row["messages"]
        if messages is None:  # a row without the column (or null there), e.g. {"text": ...} among conversations
            given = [c for c, v in raw[position].items() if v is not None]
            raise MissingColumnError(i, "messages", given, "every row of conversational data needs its conversation "
                                     "there (or give prompt-completion rows: 'prompt' and 'completion').")
        if not isinstance(messages, list) or len(messages) < 2 or not isinstance(messages[-1], dict) \
                or messages[-1].get("role") != "assistant":
            with about_row(i):
                raise DataFormatError(
                    f"row {i}, column 'messages': a conversation is split into a prompt (the messages before its "
                    "last) and a completion (its last message, the assistant's), so it needs at least two messages "
                    "and must end with an assistant message.")
    return raw.map(lambda row: {"prompt": row["messages"][:-1], "completion": row["messages"][-1:]},
                   remove_columns=["messages"], desc=f"Splitting {label} conversations")


def conversation_split_note(method: str, rows: dict[str, int], completion_use: str) -> str:
    """The fit-start line saying that conversation rows were split (``rows``: split label -> rows) and what the
    method does with each one's last assistant message (``completion_use``)."""
    counts = [f"{rows[label]} {label}" for label in ("train", "validation", "test") if rows.get(label)]
    return (f"{method}: {' and '.join(counts)} rows are conversations ('messages'): the messages before each one's "
            f"last assistant message are its prompt; that last message {completion_use}.")
