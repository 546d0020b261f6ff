"""A DataLoader that tells every micro-batch how many loss tokens its whole optimizer step holds.

With gradient accumulation the correct loss of an optimizer step is (sum of token losses of all its
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

IGNORE_INDEX = -100


def count_loss_tokens(batch: dict[str, Any]) -> int:
    """Target tokens of a batch after the next-token shift (what ``sft_loss`` averages over); for batches with a
    ``completion_mask`` instead of ``labels`` (preference pairs), the completion tokens."""
    if "labels" in batch:
        return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())
    if "completion_mask" in batch:
        return int(batch["completion_mask"][..., 1:].sum())
    return 0


class StepTokenCountingLoader(DataLoader):
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
