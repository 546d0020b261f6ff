"""The precomputed reference pass shared by DPO and KTO: every split's reference log-probs, sharded over the ranks,
gathered, cached on disk, handed to the datamodule; the reference model is released afterwards.

The module supplies ``reference_logps(batch) -> (a, b)`` (DPO: chosen and rejected; KTO: the row and its
mismatched sequence, ``b`` None without a KL term), ``reference_fingerprint()`` and its knobs
(``PrecomputeReferenceKnobs``, as ``knobs.precompute_reference``); the datamodule ``splits()``,
``reference_logps``, ``set_reference_logps``, ``eval_dataloader`` and ``val_batch_size``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from lightalign.knobs import KnobGroup, knob
from lightalign.modules.reference.model import (cache_path, images_fingerprint, load_cached, save_cached,
                                               tokenized_fingerprint)

__all__ = ["PrecomputeReferenceKnobs", "precompute_reference_logps", "sharded_reference_pass"]


@dataclasses.dataclass(frozen=True)
class PrecomputeReferenceKnobs(KnobGroup):
    """The reference log-probs computed once before training (``precompute_reference_logps``)."""

    group = "precompute_reference"
    precompute_ref_log_probs: bool = knob(
        False, "compute the reference log-probs of every row of the train and validation data once before training "
               "(DPO: chosen and rejected; KTO: each row and its mismatched sequence), cache them on disk (keyed by "
               "the reference weights and the tokenized rows) and free the reference model.")
    ref_log_probs_cache_dir: str | None = knob(
        None, "the cache folder (default ``$LIGHTALIGN_CACHE/ref_logps`` or ``~/.cache/lightalign/ref_logps``).")
    precompute_ref_batch_size: int | None = knob(
        None, "rows (DPO: pairs) per forward of the precompute pass (default: the datamodule's ``val_batch_size`` "
              "for every split; TRL defaults to the train batch size for train).")

    def check(self) -> None:
        size = self.precompute_ref_batch_size
        if size is not None and size < 1:
            raise ValueError(f"precompute_ref_batch_size must be >= 1 (or null for val_batch_size), got {size}.")
        if size is not None and not self.precompute_ref_log_probs:
            raise ValueError("precompute_ref_batch_size is the batch size of the precompute pass; set "
                             "precompute_ref_log_probs=True to use it, or drop it.")


@torch.no_grad()
def precompute_reference_logps(module: Any, datamodule: Any, columns: Sequence[str], names: tuple[str, str]) -> None:
    """Give ``datamodule`` the reference log-probs of every split (``set_reference_logps``).

    Values come from the disk cache when the same reference weights met the same tokenized rows before (the key
    hashes every weight, every token id of ``columns`` and the bytes of every image the rows show); otherwise each rank computes its share of the rows and
    the shares are gathered, and rank 0 writes the cache under the keys ``names``."""
    fingerprint = None
    was_training = module.training
    module.eval()
    for label, dataset in datamodule.splits().items():
        if label in datamodule.reference_logps:
            continue
        fingerprint = fingerprint or module.reference_fingerprint()
        path = cache_path(module.knobs.precompute_reference.ref_log_probs_cache_dir, fingerprint,
                          tokenized_fingerprint(dataset, columns) + images_fingerprint(dataset))
        cached = load_cached(path)
        if not module.trainer.strategy.reduce_boolean_decision(cached is not None, all=True):
            first, second = sharded_reference_pass(module, datamodule, dataset)
            cached = {names[0]: first, names[1]: second}
            if module.trainer.is_global_zero:
                save_cached(path, cached)
        datamodule.set_reference_logps(label, cached[names[0]], cached[names[1]])
    module.train(was_training)
    if module.ref_model is not None or getattr(module, "_policy_is_reference", False):
        module.ref_model = None
        module._policy_is_reference = False
        module._ref_released = True


@torch.no_grad()
def sharded_reference_pass(module: Any, datamodule: Any, dataset: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference log-probs of every row of ``dataset``, in row order: rank ``r`` of ``W`` computes the contiguous
    rows ``[n*r//W, n*(r+1)//W)``, then the shares are all-gathered. Every rank runs the same number of forwards
    (a short share repeats its last batch and drops the result), so a sharded policy acting as its own reference
    (FSDP, ZeRO-3) meets its collectives in step. A second value of None (KTO without a KL term) gives zeros."""
    trainer = module.trainer
    world, rank, n = trainer.world_size, trainer.global_rank, len(dataset)
    bounds = [n * r // world for r in range(world + 1)]
    batch_size = module.knobs.precompute_reference.precompute_ref_batch_size or datamodule.val_batch_size
    steps = max(-(-(bounds[r + 1] - bounds[r]) // batch_size) for r in range(world))
    start, stop = bounds[rank], bounds[rank + 1]
    # an empty share (fewer rows than ranks) computes row 0 and drops it
    share = dataset.select(range(start, stop)) if stop > start else dataset.select([0])
    batches = iter(datamodule.eval_dataloader(share, "reference", batch_size=batch_size))
    firsts, seconds, batch = [], [], None
    for _ in range(steps):
        real = next(batches, None)
        batch = real if real is not None else batch  # a short share repeats its last batch
        # tensors and the rows' image inputs (ImageInputs) move; host lists and strings stay
        a, b = module.reference_logps({k: v.to(module.device) if hasattr(v, "to") else v for k, v in batch.items()})
        if real is not None and stop > start:
            firsts.append(a.float())
            seconds.append(b.float() if b is not None else torch.zeros_like(a, dtype=torch.float32))
    mine = torch.stack([torch.cat(firsts), torch.cat(seconds)]) if firsts else torch.zeros(2, 0, device=module.device)
    if world == 1:
        return mine[0].cpu(), mine[1].cpu()
    widest = max(bounds[r + 1] - bounds[r] for r in range(world))
    padded = torch.zeros(2, widest, device=module.device)
    padded[:, : mine.shape[1]] = mine
    everyone = module.all_gather(padded)  # [W, 2, widest]
    full = torch.cat([everyone[r, :, : bounds[r + 1] - bounds[r]] for r in range(world)], dim=1).cpu()
    return full[0], full[1]
