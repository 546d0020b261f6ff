"""``TokenizedDataModule``: what every lightalign datamodule shares — sources, splits, tokenizer, loaders.

A subclass says how raw rows become tokenized rows (``prepare_rows``) and how rows become a batch
(``default_collator``); this base loads the train/validation/test sources, loads the tokenizer once, and
builds the DataLoaders (the training one counts loss tokens per optimizer step; none draws from the global torch
RNG, see ``step_loader``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader

from lightalign.datamodules.check_verdicts import passed, rows_key
from lightalign.datamodules.formats import DataFormatError, resolve_chat_template
from lightalign.datamodules.index_samplers import EpochSampler
from lightalign.datamodules.sources import describe, load_rows, row_line
from lightalign.datamodules.step_loader import SeededLoader, StepTokenCountingLoader
from lightalign.hub import load_tokenizer

if TYPE_CHECKING:  # datasets (with pandas, pyarrow) is imported where rows are read, not for --help
    from datasets import Dataset


class TokenizedDataModule(L.LightningDataModule):
    """Shared arguments of lightalign datamodules.

    Args:
        path: training data: a local json/jsonl/parquet/csv file or folder, a hub dataset name, or a ``Dataset``.
        tokenizer: a tokenizer or its name/path (the CLI links it to the model's ``model_name_or_path``).
        split: split of ``path`` to train on.
        name: dataset configuration name (hub datasets with several configs).
        val_path: validation data (same kinds as ``path``).
        val_split: a split of ``path`` to validate on (e.g. ``test``).
        val_split_size: carve this fraction (<1) or number (>=1) of rows out of the training data for validation.
        test_path: data for ``lightalign test`` (defaults to the validation data).
        batch_size: rows per micro-batch per device.
        val_batch_size: per-device batch size for validation and test (default: ``batch_size``).
        chat_template: override the tokenizer's chat template (Jinja text or a path to a file).
        collator: a callable turning a list of tokenized rows into a batch (replaces the default collator).
        num_workers: DataLoader workers.
        dataset_num_proc: processes for tokenization.
        shuffle: shuffle the training rows every epoch.
        seed: seed of the validation carve-out and of the shuffle order.
        processor_kwargs: for a vision-language model, passed to its processor's ``from_pretrained`` (the image
            budget: ``min_pixels``/``max_pixels`` for Qwen-VL, ``size`` ...).
    """

    def __init__(
        self,
        path: Any = None,
        tokenizer: Any = None,
        *,
        split: str = "train",
        name: str | None = None,
        val_path: Any = None,
        val_split: str | None = None,
        val_split_size: float = 0.0,
        test_path: Any = None,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        chat_template: str | None = None,
        collator: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]] | None = None,
        num_workers: int = 0,
        dataset_num_proc: int | None = None,
        shuffle: bool = True,
        seed: int = 42,
        processor_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if path is None:
            raise ValueError(f"{type(self).__name__} needs `path`: a data file, a folder, a hub dataset name or a Dataset.")
        if tokenizer is None:
            raise ValueError(f"{type(self).__name__} needs `tokenizer` (a tokenizer or a model name/path).")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        if val_split_size < 0:
            raise ValueError(f"val_split_size must be >= 0, got {val_split_size}.")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (0: load batches in the training process), got {num_workers}.")
        self.path, self.split, self.name = path, split, name
        self.val_path, self.val_split, self.val_split_size, self.test_path = val_path, val_split, val_split_size, test_path
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.chat_template = chat_template
        self.collator = collator
        self.num_workers, self.dataset_num_proc = num_workers, dataset_num_proc
        self.shuffle, self.seed = shuffle, seed
        self._tokenizer_arg = tokenizer
        self.tokenizer = tokenizer if not isinstance(tokenizer, str) else None
        self.processor_kwargs = processor_kwargs
        # a vision-language model's processor (None for a text model) and how its outputs batch (ImageKeyLayout)
        self.processor: Any = None
        self.image_layout: Any = None
        if self.tokenizer is not None and hasattr(self.tokenizer, "image_processor"):  # a processor passed as is
            self.processor, self.tokenizer = self.tokenizer, self.tokenizer.tokenizer
        # While a split is prepared: the folder its relative image paths are read from (image_base_dir).
        self.image_base_dir: Any = None
        self._image_splits: set[str] = set()  # the splits of a vision-language model's data with an image column
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self._prepared = False
        # While a split is prepared: each of its rows' number in the user's data (None: its position), for errors.
        self.row_numbers: list[int] | None = None

    # ------------------------------------------------------------------------------------- to override
    def prepare_rows(self, raw: Dataset, tokenizer: Any, label: str) -> Dataset:
        """Validate and tokenize one split; ``label`` is ``train``/``validation``/``test`` for messages.

        Errors about a row name it by ``self.row_numbers`` (``formats.iter_rows(raw, columns, self.row_numbers)``)."""
        raise NotImplementedError

    def default_collator(self) -> Callable:
        raise NotImplementedError

    def validate_once(self, raw: Dataset, settings: dict[str, Any], validate: Callable[[], None]) -> None:
        """``validate()`` (a split's row validation), skipped when it passed before on the same rows (``raw``'s
        fingerprint) with the same ``settings`` (every setting it reads) and datamodule class: ``check_verdicts``
        says why the fingerprint is the key."""
        passed("rows", rows_key(raw, type(self), settings), validate)

    # ------------------------------------------------------------------------------------- setup
    def load_tokenizer(self) -> Any:
        """The tokenizer; for a vision-language model also its processor (``self.processor``, whose tokenizer this
        is) and the batch layout of the processor's outputs (``self.image_layout``)."""
        if self.tokenizer is None:
            if _names_vision_language_model(self._tokenizer_arg):
                from lightalign.vision import load_processor

                self.processor = load_processor(self._tokenizer_arg, self.processor_kwargs)
                self.tokenizer = self.processor.tokenizer
            else:
                self.tokenizer = load_tokenizer(self._tokenizer_arg)
        if self.processor is None and self.processor_kwargs:
            raise ValueError(f"processor_kwargs {sorted(self.processor_kwargs)} apply to a vision-language model's "
                             f"processor, and '{self._tokenizer_arg}' is a text model; remove processor_kwargs.")
        template = resolve_chat_template(self.chat_template)
        if template is not None:
            self.tokenizer.chat_template = template
            if self.processor is not None:
                self.processor.chat_template = template
        if self.processor is not None and self.image_layout is None:
            from lightalign.vision import measure_key_layout

            self.image_layout = measure_key_layout(self.processor)
        return self.tokenizer

    def setup(self, stage: str | None = None) -> None:
        """Load, validate and tokenize every split once (before any model is built)."""
        if self._prepared:
            return
        tokenizer = self.load_tokenizer()
        raw_train = load_rows(self.path, split=self.split, name=self.name)
        train_numbers = val_numbers = None
        raw_val, val_source = None, self.val_path
        if self.val_path is not None:
            raw_val = load_rows(self.val_path, split="train" if self.val_split is None else self.val_split)
        elif self.val_split is not None:
            raw_val, val_source = load_rows(self.path, split=self.val_split, name=self.name), self.path
        elif self.val_split_size:
            size = self.val_split_size
            size = int(size) if size >= 1 else size  # a row count, or a fraction
            held = size if isinstance(size, int) else math.ceil(size * len(raw_train))  # as train_test_split counts
            if held >= len(raw_train):
                raise DataFormatError(
                    f"val_split_size={self.val_split_size:g} asks for {held} validation rows but '{describe(self.path)}' "
                    f"has {len(raw_train)} rows, which would leave none to train on. Use fewer rows, or a fraction "
                    "below 1 (e.g. 0.1).")
            parts = raw_train.train_test_split(test_size=size, seed=self.seed, shuffle=True)
            raw_train, raw_val, val_source = parts["train"], parts["test"], self.path
            # the same split of the row numbers, so errors name rows as they are in the user's file
            from datasets import Dataset

            numbers = Dataset.from_dict({"row": range(len(parts["train"]) + len(parts["test"]))})
            numbers = numbers.train_test_split(test_size=size, seed=self.seed, shuffle=True)
            train_numbers, val_numbers = numbers["train"]["row"][:], numbers["test"]["row"][:]  # lists: read per row
        self.train_dataset = self._prepare(raw_train, tokenizer, "train", self.path, train_numbers)
        if raw_val is not None:
            self.val_dataset = self._prepare(raw_val, tokenizer, "validation", val_source, val_numbers)
        if self.test_path is not None:
            self.test_dataset = self._prepare(load_rows(self.test_path), tokenizer, "test", self.test_path, None)
        else:
            self.test_dataset = self.val_dataset
        self._prepared = True

    def _prepare(self, raw: Dataset, tokenizer: Any, label: str, source: Any, numbers: list[int] | None) -> Dataset:
        """``prepare_rows`` with ``self.row_numbers`` set for the split; its errors name the data they are about."""
        from lightalign.vision.images import image_base_dir, image_column

        self.row_numbers, self.image_base_dir = numbers, image_base_dir(source)
        try:
            prepared = self.prepare_rows(raw, tokenizer, label)
            if self.processor is not None and image_column(raw.column_names) is not None:
                self._image_splits.add(label)
            return prepared
        except DataFormatError as err:
            row = getattr(err, "row", None)  # an error about one row (MissingColumnError): the file's line too
            line = row_line(source, row) if row is not None else None
            at = f", line {line}" if line is not None else ""
            raise DataFormatError(f"{label} data '{describe(source)}'{at}: {err}") from err
        finally:
            self.row_numbers = self.image_base_dir = None

    @property
    def has_images(self) -> bool:
        """Whether a prepared split is a vision-language model's data with an image column (a method not measured
        with images refuses it at setup: ``PolicyModule.refuse_unmeasured_images``)."""
        return bool(self._image_splits)

    # ------------------------------------------------------------------------------------- loaders
    def collate_fn(self) -> Callable:
        return self.collator if self.collator is not None else self.default_collator()

    def train_dataloader(self) -> DataLoader:
        accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        self.use_train_sampler(self.make_epoch_sampler())
        return StepTokenCountingLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=self._train_sampler,
            collate_fn=self.collate_fn(),
            num_workers=self.num_workers,
            accumulate_grad_batches=accumulate,
            seed=self.seed,
        )

    def make_epoch_sampler(self) -> EpochSampler:
        """The training order: seeded per epoch, this rank's shard under DDP, resumable mid-epoch."""
        return EpochSampler(len(self.train_dataset), **self.sampler_kwargs())

    def sampler_kwargs(self) -> dict[str, Any]:
        """Shuffle, seed and this rank's place among the replicas: what every training sampler is built with."""
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        return {"shuffle": self.shuffle, "seed": self.seed, "num_replicas": world, "rank": rank}

    # ------------------------------------------------------------------------------------- exact resume
    def state_dict(self) -> dict[str, Any]:
        """Saved in every checkpoint of a fit: where training is inside the epoch (batches already trained on),
        also in one written during a validation inside the fit (``RunCheckpoint`` after a step's validation, a
        ``ModelCheckpoint`` monitoring ``val/*``), which resumes with the next training batch."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return {}
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        return {"epoch": trainer.current_epoch, "batches_done": progress.processed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_state = dict(state_dict) if state_dict else None
        self._apply_resume()

    def use_train_sampler(self, sampler: Any) -> None:
        """Make ``sampler`` the training sampler, starting where a restored checkpoint left off.

        A sampler built earlier and never iterated hands its pending resume point on: DeepSpeed builds a training
        loader before the checkpoint is restored (to read its batch size), so the restore reaches that loader
        and the fit loop then builds a fresh one, which would start the epoch over.
        """
        pending = getattr(getattr(self, "_train_sampler", None), "_resume", None)
        self._train_sampler = sampler
        if pending is not None:
            sampler._resume = pending
        self._apply_resume()

    def _apply_resume(self) -> None:
        state, sampler = getattr(self, "_resume_state", None), getattr(self, "_train_sampler", None)
        if not state or sampler is None:
            return
        if isinstance(sampler, EpochSampler):
            sampler.resume(state["epoch"], state["batches_done"] * self.batch_size)
        else:
            sampler.resume(state["epoch"], state["batches_done"])
        self._resume_state = None

    def eval_dataloader(self, dataset: Dataset | None, what: str = "evaluation",
                        batch_size: int | None = None) -> DataLoader:
        """An ordered loader over ``dataset`` (validation, test, or a reference log-prob pass), in batches of
        ``batch_size`` (default ``val_batch_size``)."""
        if dataset is None:
            raise DataFormatError(f"No {what} data: set val_path, val_split or val_split_size (or test_path).")
        return SeededLoader(dataset, batch_size=batch_size or self.val_batch_size, collate_fn=self.collate_fn(),
                            num_workers=self.num_workers, seed=self.seed)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            return []
        return self.eval_dataloader(self.val_dataset, "validation")

    def test_dataloader(self) -> DataLoader:
        return self.eval_dataloader(self.test_dataset, "test")


def _names_vision_language_model(name: Any) -> bool:
    """Whether a tokenizer argument names a vision-language model's folder or hub repository (its config says so);
    a tokenizer-only folder (no ``config.json``) is a text tokenizer."""
    from pathlib import Path

    from lightalign.hub import is_vision_language_model

    if not isinstance(name, (str, Path)):
        return False
    folder = Path(name).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        return False
    try:
        return is_vision_language_model(str(name))
    except OSError:  # no config reachable for a hub name: load_tokenizer then says what is missing
        return False
