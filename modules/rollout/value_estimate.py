"""The value-estimation stage that runs once before an online-RL method trains (A*-PO's first stage).

``num_value_samples`` completions per training prompt are sampled from the reference model (the run's sampling
knobs, ``Sampling.sample`` as ``who="reference"``), scored by the run's reward functions, and each prompt's
optimal value is the soft maximum of its rewards at temperature ``beta1`` (``optimal_values``, TRL 1.16's
``A2POTrainer._estimate_optimal_values``):

    V*(x) = beta1 * log(mean_i exp(r(x, y_i) / beta1))

The prompts are taken in chunks of one rollout's prompts; each chunk is sampled in its own random stream (seeded by
the data seed and the chunk's index, forked from the training stream, which it leaves untouched) and its rewards are
written to the cache as one file, atomically (``save_cached``). The cache folder is keyed by everything the rewards
depend on (``value_cache_key``): the reference weights, every column of every training row, the sampling knobs and
sampler, ``num_value_samples``, the reward functions' names and weights, the seed and the chunk size. So a second run
loads the rewards instead of sampling; a run killed during the estimation finds its finished chunks there and samples
only the others, and gets the rewards the uninterrupted run got. ``beta1`` is not part of the key: the rewards are
cached, ``V*`` is computed from them. Under data parallelism rank ``r`` of ``W`` takes the chunks ``c`` with
``c % W == r`` and the rewards are all-gathered.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightalign.knobs import KnobGroup, knob
from lightalign.modules.reference.model import model_fingerprint, save_cached

__all__ = ["OptimalValues", "ValueEstimateKnobs", "all_incorrect", "estimate_rewards", "optimal_values"]

CHUNK_SEED_STRIDE = 1_000_003  # chunk c of a run with data seed s samples with seed s * stride + c


@dataclasses.dataclass(frozen=True)
class ValueEstimateKnobs(KnobGroup):
    """The offline estimate of each training prompt's optimal value ``V*`` from reference samples (TRL 1.16's
    Stage 1 knobs of ``A2POConfig``), and where it is cached."""

    group = "value_estimate"
    num_value_samples: int = knob(8, "completions sampled from the reference model per training prompt to estimate "
                                     "its optimal value ``V*``.")
    beta1: float = knob(0.5, "the KL temperature of the estimate: ``V* = beta1 * log(mean_i exp(r_i / beta1))`` "
                             "(near the mean reward when large, near the best reward when small); > 0.")
    filter_all_incorrect: bool = knob(True, "drop the training prompts whose reference samples all got reward 0 "
                                            "(no learning signal).")
    value_cache_dir: str | None = knob(
        None, "the folder of the estimate's cache, one subfolder per key (default ``$LIGHTALIGN_CACHE/a2po_values`` "
              "or ``~/.cache/lightalign/a2po_values``). Not a TRL knob: TRL keeps the estimate in memory.")

    def check(self) -> None:
        if self.num_value_samples < 1:
            raise ValueError(f"num_value_samples must be >= 1 (reference samples per prompt), got "
                             f"{self.num_value_samples}.")
        if not self.beta1 > 0:
            raise ValueError(f"beta1 must be > 0 (the temperature of V* = beta1 * log(mean exp(r / beta1)); TRL's "
                             f"default is 0.5), got {self.beta1}.")


def optimal_values(rewards: torch.Tensor, beta1: float) -> torch.Tensor:
    """``V*`` per prompt ``[P]`` from the rewards of its reference samples ``[P, N]``:
    ``beta1 * (logsumexp(r / beta1) - log N)``, stable for any ``beta1``."""
    return beta1 * (torch.logsumexp(rewards / beta1, dim=-1) - math.log(rewards.shape[-1]))


def all_incorrect(rewards: torch.Tensor) -> torch.Tensor:
    """The prompts ``[P]`` whose reference samples ``[P, N]`` all scored 0 (TRL's test: the rewards sum to 0)."""
    return rewards.sum(-1) == 0


def prompt_key(ids: Sequence[int]) -> tuple[int, ...]:
    """A prompt's identity in the table: its token ids (after truncation, without padding)."""
    return tuple(int(i) for i in ids)


class OptimalValues:
    """``V*`` of every training prompt, in the rows' order, with the rows whose reference samples all scored 0; looked
    up by a rollout's left-padded prompt ids."""

    def __init__(self, prompt_ids: Sequence[Sequence[int]], values: torch.Tensor, all_incorrect: torch.Tensor) -> None:
        self.values, self.all_incorrect = values.float().cpu(), all_incorrect.bool().cpu()
        self.row_of = {prompt_key(ids): i for i, ids in enumerate(prompt_ids)}

    def lookup(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        """``V*`` ``[B]`` of left-padded prompts ``[B, P]`` (on their device)."""
        rows = []
        for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist()):
            key = prompt_key(i for i, m in zip(ids, mask) if m)
            if key not in self.row_of:
                raise KeyError(f"A rollout's prompt ({len(key)} tokens) is not among the training prompts whose V* "
                               "was estimated at fit start.")
            rows.append(self.row_of[key])
        return self.values[rows].to(prompt_ids.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"values": self.values, "all_incorrect": self.all_incorrect}


def default_value_cache_dir() -> Path:
    root = os.environ.get("LIGHTALIGN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lightalign")
    return Path(root) / "a2po_values"


def data_fingerprint(dataset: Any) -> str:
    """Every column of every row (the prompts' token ids and whatever the reward functions read), in row order."""
    h = hashlib.blake2b(digest_size=16)
    names = sorted(dataset.column_names)
    h.update(f"{len(dataset)}:{names}".encode())
    for table in dataset.select_columns(names).with_format("arrow").iter(batch_size=4096):
        for name in names:
            h.update(json.dumps(table.column(name).to_pylist(), sort_keys=True, default=str).encode())
    return h.hexdigest()


def value_cache_key(module: Any, dataset: Any, num_samples: int, seed: int, chunk: int) -> str:
    """The key of the cached rewards: what they depend on (see the module docstring)."""
    with module.reference.model_for(module.ref_model, module.model) as ref:
        reference = model_fingerprint(ref)
        sampler = module.sampling.backend(ref, "reference", num_samples)
    facts = {"reference": reference, "data": data_fingerprint(dataset), "sampling": module.sampling.sampling_kwargs(),
             "sampler": sampler, "num_value_samples": num_samples, "rewards": list(module.reward_names),
             "weights": [float(w) for w in module.reward_weights], "seed": seed, "chunk": chunk,
             "fallback": module.hparams.reward_fallback_value}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


@torch.no_grad()
def sample_chunk_rewards(module: Any, batch: dict[str, Any], num_samples: int, seed: int) -> torch.Tensor:
    """The rewards ``[P, N]`` of ``num_samples`` reference completions per prompt of ``batch``, sampled in a random
    stream of their own (``seed``)."""
    from lightalign.rewards import compute_rewards
    from lightalign.rewards.trl_kwargs import RewardLogs, RewardTrainerState

    device = module.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with module.reference.model_for(module.ref_model, module.model) as ref:
            rollout = module.sampling.sample(ref, module.tokenizer, move_data_to_device(batch, device), num_samples,
                                             who="reference", largest_group=num_samples)
    columns = {**rollout["columns"], **RewardLogs().kwargs(RewardTrainerState.of(module))}
    hp = module.hparams
    scores = compute_rewards(module.reward_funcs, rollout["prompts"], rollout["completions"], columns,
                             module.reward_weights, reward_timeout=hp.reward_timeout,
                             reward_fallback_value=hp.reward_fallback_value)
    total = scores.total.float()
    if torch.isnan(total).any():
        row = int(torch.isnan(total).nonzero()[0, 0])
        raise ValueError(f"No reward function scored reference sample {row % num_samples} of prompt "
                         f"{rollout['prompts'][row]!r} (every function returned None): the V* estimate needs a reward "
                         "for every sample. Return a number for it, or set reward_fallback_value.")
    return total.view(-1, num_samples).cpu()


def estimate_rewards(module: Any, dataset: Any, collate: Any, num_samples: int, seed: int, chunk: int,
                     cache_dir: str | None) -> tuple[torch.Tensor, int, int, Path]:
    """The rewards ``[n, N]`` of ``N = num_samples`` reference samples of each of the ``n`` rows of ``dataset`` (one
    chunk of ``chunk`` rows at a time, through ``collate``), each chunk loaded from the cache or sampled and written
    there; returns them with the prompts sampled now and loaded from the cache (over every rank) and the folder."""
    trainer = module.trainer
    world, rank, n = trainer.world_size, trainer.global_rank, len(dataset)
    folder = Path(cache_dir or default_value_cache_dir()) / value_cache_key(module, dataset, num_samples, seed, chunk)
    rewards = torch.zeros(n, num_samples)
    sampled = loaded = 0
    for c in range(rank, -(-n // chunk), world):
        rows = range(c * chunk, min(n, (c + 1) * chunk))
        path = folder / f"chunk_{c:06d}.pt"
        if path.is_file():
            part = torch.load(path, map_location="cpu", weights_only=True)["rewards"]
            loaded += len(rows)
        else:
            part = sample_chunk_rewards(module, collate([dataset[i] for i in rows]), num_samples,
                                        seed * CHUNK_SEED_STRIDE + c)
            save_cached(path, {"rewards": part})
            sampled += len(rows)
        rewards[rows.start:rows.stop] = part
    counts = torch.tensor([sampled, loaded], dtype=torch.float64)
    if world > 1:  # each row's chunk belongs to one rank: the others hold zeros there
        rewards = module.all_gather(rewards.to(module.device)).sum(0).cpu()
        counts = module.all_gather(counts.to(module.device)).sum(0).cpu()
    return rewards, int(counts[0]), int(counts[1]), folder
