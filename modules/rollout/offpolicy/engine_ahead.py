"""``EngineAhead``: rollouts sampled ahead of training by a vLLM server (``use_vllm``, ``vllm_mode: server``), one
rollout ahead, on a background thread of the training process.

The server holds one set of weights, so a rollout is sampled with one version only if no weights arrive while it
runs: weights are pushed only between rollouts, when nothing is in flight. At the start of rollout ``j`` the
training process takes rollout ``j`` (asked for one rollout earlier), pushes the policy's current weights, and asks
for rollout ``j + 1``, which the server samples while rollout ``j`` trains. One rollout ahead is the most this
allows: asking for ``j + 2`` before ``j + 1`` is taken would leave no moment to push between them. The weights of
a rollout are then one rollout's optimizer steps old (within ``max_staleness``, which bounds it).

It has ``AheadSampler``'s interface, so the off-policy component drives both the
same way: the seeds (drawn on the training thread), the checkpointed rollouts not yet trained, the errors.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from lightalign.modules.sampling.completions import assemble_rollout
from lightalign.modules.rollout.offpolicy.bookkeeping import RolloutsAhead, SamplerProcessError


class EngineAhead(RolloutsAhead):
    """One rollout ahead on a vLLM engine (see the module docstring). ``push()`` puts the policy's current weights
    into the engine (every rank waits until they are in); ``sampling``: ``Sampler.sample``'s keyword arguments."""

    depth = 1

    def __init__(self, sampler: Any, push: Callable[[], None], tokenizer: Any, eos: list[int],
                 sampling: dict[str, Any]) -> None:
        super().__init__()
        self.sampler, self.push_weights, self.tokenizer, self.eos = sampler, push, tokenizer, eos
        self.sampling = sampling
        self.pool: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightalign-vllm")
        self.futures: dict[int, Future] = {}  # rollout index in flight -> its sampling on the background thread

    def slot_of(self, index: int) -> int:
        return 0

    def push(self, slot: int, model: torch.nn.Module) -> None:
        """The policy's current weights into the engine; refused while a rollout is being sampled."""
        if self.in_flight:
            raise SamplerProcessError(f"Weights pushed to the vLLM server while rollouts {sorted(self.in_flight)} are "
                                      "being sampled would change them under a running rollout.")
        self.push_weights()

    def submit(self, index: int, version: int, batch: dict[str, Any], num_generations: int, seed: int) -> None:
        if self.pool is None:
            raise SamplerProcessError("The vLLM rollouts sampled ahead were closed.")
        self.in_flight[index] = version
        self.futures[index] = self.pool.submit(self._sample, batch, num_generations, seed)

    def _sample(self, batch: dict[str, Any], num_generations: int, seed: int) -> tuple[dict[str, Any], float]:
        """Runs on the background thread: the engine's completions for ``batch``, assembled as every rollout is (the
        policy is not touched: it trains meanwhile)."""
        start = time.perf_counter()
        samples = self.sampler.sample(None, batch["prompt_input_ids"], batch["prompt_attention_mask"], num_generations,
                                      eos=self.eos, pad_token_id=self.tokenizer.pad_token_id, return_logprobs=True,
                                      seed=seed, **self.sampling)
        rollout = assemble_rollout(self.tokenizer, batch, num_generations, samples, self.eos)
        return rollout, time.perf_counter() - start

    def _wait_for(self, index: int) -> None:
        if index in self.done:
            return
        version, future = self.in_flight.pop(index), self.futures.pop(index)
        try:
            rollout, seconds = future.result()  # bounded: each request to the server has vllm_server_timeout
        except Exception as err:
            raise SamplerProcessError(f"Sampling rollout {index} on the vLLM server failed: {err}") from err
        self.done[index] = {"rollout": rollout, "version": version, "seconds": seconds}

    def close(self) -> None:
        """Stop taking requests (a request already sent ends within its timeout; its rollout is dropped)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
        self.in_flight.clear()
        self.futures.clear()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.futures.clear()
