"""Resumable samplers: the order of an epoch is a pure function of (seed, epoch), so a run restarted from a
checkpoint mid-epoch skips exactly the batches it had trained on — no batch repeated, none lost.

Lightning calls ``set_epoch`` on ``dataloader.sampler`` / ``dataloader.batch_sampler.sampler`` each epoch; the
datamodule calls ``resume(epoch, n)`` when it is restored from a checkpoint.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler


class EpochSampler(Sampler[int]):
    """A seeded permutation per epoch (or the plain order), resumable at any index."""

    def __init__(self, num_rows: int, shuffle: bool = True, seed: int = 0) -> None:
        self.num_rows, self.shuffle, self.seed = num_rows, shuffle, seed
        self.epoch = 0
        self._resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume(self, epoch: int, num_indices: int) -> None:
        """The next iteration over ``epoch`` starts after its first ``num_indices`` indices."""
        self._resume = (epoch, num_indices)

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        skip = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            skip = self._resume[1]
        self._resume = None
        yield from self.order()[skip:]

    def __len__(self) -> int:
        return self.num_rows


class RepeatBatchSampler(Sampler[list[int]]):
    """Yields each generation batch of prompt indices ``repeat`` times in a row (GRPO rollouts).

    One rollout serves ``steps_per_generation x num_iterations`` training steps; Lightning calls
    ``training_step`` once per loader batch, so the loader hands the same prompts to each of them and the module
    generates on the first. Incomplete last generation batches are dropped.
    """

    def __init__(self, sampler: EpochSampler, batch_size: int, repeat: int) -> None:
        self.sampler, self.batch_size, self.repeat = sampler, batch_size, repeat
        self._resume: tuple[int, int] | None = None

    def resume(self, epoch: int, num_batches: int) -> None:
        self._resume = (epoch, num_batches)

    def __iter__(self) -> Iterator[list[int]]:
        skip = 0
        if self._resume is not None and self._resume[0] == self.sampler.epoch:
            skip = self._resume[1]
        self._resume = None
        order = self.sampler.order()
        n = 0
        for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
            batch = order[start : start + self.batch_size]
            for _ in range(self.repeat):
                if n >= skip:
                    yield batch
                n += 1

    def __len__(self) -> int:
        return (self.sampler.num_rows // self.batch_size) * self.repeat
