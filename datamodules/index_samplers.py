"""Resumable index samplers of the dataloaders (which rows, in which order; not token sampling): the order of an
epoch is a pure function of (seed, epoch), so a run restarted from a checkpoint mid-epoch skips exactly the batches
it had trained on — no batch repeated, none lost.

Lightning calls ``set_epoch`` on ``dataloader.sampler`` / ``dataloader.batch_sampler.sampler`` each epoch; the
datamodule calls ``resume(epoch, n)`` when it is restored from a checkpoint.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from torch.utils.data import DistributedSampler, Sampler


class EpochSampler(DistributedSampler):
    """A seeded permutation per epoch (or the plain order), sharded over ranks, resumable at any index.

    It is a ``DistributedSampler`` (built with explicit ``num_replicas``/``rank``, so it works without a process
    group), which tells Lightning to use it as is instead of wrapping it: each rank knows its own shard and can
    skip exactly the samples it trained on.
    """

    def __init__(self, num_rows: int, shuffle: bool = True, seed: int = 0, num_replicas: int = 1, rank: int = 0,
                 drop_last: bool = False) -> None:
        super().__init__(range(num_rows), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.num_rows = num_rows
        self._resume: tuple[int, int] | None = None

    def resume(self, epoch: int, num_indices: int) -> None:
        """The next iteration over ``epoch`` starts after this rank's first ``num_indices`` indices."""
        self._resume = (epoch, num_indices)

    def order(self) -> list[int]:
        """This rank's indices for the current epoch, in order."""
        return list(super().__iter__())

    def __iter__(self) -> Iterator[int]:
        skip = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            skip = self._resume[1]
        self._resume = None
        yield from self.order()[skip:]


class LengthGroupedSampler(EpochSampler):
    """``group_by_length``: rows of similar length batched together, so padded batches carry little padding.

    Each epoch's seeded permutation is cut into mega-batches of ``mega_batch_mult x batch_size x replicas``
    rows; each mega-batch is sorted by length, longest first, then dealt over the ranks like any
    ``DistributedSampler`` order. The order stays a pure function of (seed, epoch), so resuming works as
    for ``EpochSampler``; batches are still random across mega-batches.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, mega_batch_mult: int = 50, **kwargs) -> None:
        super().__init__(len(lengths), **kwargs)
        self.lengths = list(lengths)
        self.mega = max(1, mega_batch_mult * batch_size * self.num_replicas)

    def order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            perm = torch.randperm(self.num_rows, generator=g).tolist()
        else:
            perm = list(range(self.num_rows))
        grouped = []
        for start in range(0, len(perm), self.mega):
            grouped += sorted(perm[start : start + self.mega], key=lambda i: -self.lengths[i])
        if self.drop_last:
            grouped = grouped[: self.total_size]
        else:
            while len(grouped) < self.total_size:  # pad by repeating the start, as DistributedSampler does
                grouped += grouped[: self.total_size - len(grouped)]
        return grouped[self.rank : self.total_size : self.num_replicas]


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
        return (len(self.sampler) // self.batch_size) * self.repeat
