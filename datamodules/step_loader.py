"""The DataLoaders of lightalign: ``SeededLoader`` (draws nothing from the global torch RNG) and
``StepTokenCountingLoader`` (tells every micro-batch how many loss tokens its whole optimizer step holds).

A plain ``DataLoader`` draws its workers' base seed from the global torch RNG each time it is iterated. The
training RNG (dropout, NEFTune noise, GRPO sampling) is restored from the checkpoint on resume, so that extra
draw would put a resumed run one draw off the uninterrupted one. ``SeededLoader`` draws it from its own
generator instead, reseeded at every iteration from (seed, epoch, rank): a pure function of where the run is,
so a resumed run draws what the uninterrupted run drew, with nothing to save in the checkpoint.

``StepTokenCountingLoader``: with gradient accumulation the correct loss of an optimizer step is (sum of token losses of all its
micro-batches) / (number of target tokens of all its micro-batches). A micro-batch alone cannot know the
denominator, so this loader reads the ``accumulate_grad_batches`` batches of a step ahead and stamps each with
``num_items_in_batch``. (TRL and transformers shipped the per-micro-batch mean for a long time:
trl#2175, transformers#34191.)
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

from lightalign.datamodules.collators import IGNORE_INDEX  # (defined once: the label the collators write)


def count_loss_tokens(batch: dict[str, Any]) -> int:
    """Target tokens of a batch after the next-token shift (what ``sft_loss`` averages over); for batches with a
    ``completion_mask`` instead of ``labels`` (preference pairs), the completion tokens."""
    if "labels" in batch:
        return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())
    if "completion_mask" in batch:
        return int(batch["completion_mask"][..., 1:].sum())
    return 0


def loader_seed(seed: int, epoch: int, rank: int) -> int:
    """The base seed stream of a loader at ``epoch`` on ``rank`` (distinct per rank, so workers differ)."""
    return ((seed * 1_000_003 + epoch) * 1_000_033 + rank) % (2**63)


class SeededLoader(DataLoader):
    """A ``DataLoader`` whose generator is its own, reseeded from (``seed``, epoch, rank) at every iteration.

    The epoch and rank are read from the sampler (``EpochSampler`` / ``DistributedSampler``: ``set_epoch`` runs
    before each epoch's iteration); other samplers count as epoch 0, rank 0.
    """

    def __init__(self, *args: Any, seed: int = 0, **kwargs: Any) -> None:
        if kwargs.get("generator") is None:
            kwargs["generator"] = torch.Generator()
        super().__init__(*args, **kwargs)
        self.seed = seed

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        self.generator.manual_seed(loader_seed(self.seed, getattr(sampler, "epoch", 0), getattr(sampler, "rank", 0)))
        return super().__iter__()


class StepTokenCountingLoader(SeededLoader):
    """``DataLoader`` whose batches carry ``num_items_in_batch``: target tokens of their optimizer step.

    Groups are consecutive runs of ``accumulate_grad_batches`` batches from the start of the epoch, as
    Lightning groups them; the last group of an epoch may be shorter.
    """

    def __init__(self, *args: Any, accumulate_grad_batches: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be >= 1, got {accumulate_grad_batches}.")
        self.accumulate_grad_batches = accumulate_grad_batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        base = super().__iter__()
        while True:
            group = list(itertools.islice(base, self.accumulate_grad_batches))
            if not group:
                return
            total = torch.tensor(sum(count_loss_tokens(b) for b in group))
            for batch in group:
                batch["num_items_in_batch"] = total
                yield batch
