"""``AheadSampler``: rollouts sampled ahead of training, in a separate process, by weights at most a bounded number
of optimizer steps old.

With ``depth`` rollouts ahead, at the start of rollout ``j`` (its first training step) the training process takes
rollout ``j`` (sampled earlier), writes the policy's current weights into slot ``(j + depth) % depth`` and asks for
rollout ``j + depth`` on it; the sampling process works on it while rollout ``j`` trains. Slot ``s`` is written only
after the last rollout sampled on it was taken, so weights never change under a running rollout. A run with
nothing in flight (its first rollout, or a resume from a checkpoint holding none) asks for rollouts ``j .. j +
depth`` at once on the current weights. With ``m`` optimizer steps per rollout the weights rollout ``j`` was
sampled with are then at most ``depth * m`` steps older than the policy that starts training on it.

Every rollout's seed is drawn from the training process's torch RNG when it is asked for, so a seeded run samples
the same rollouts whatever the timing. A checkpoint waits for the rollouts in flight and keeps them
(``state_dict``): a run resumed from it trains on exactly what the uninterrupted run trained on.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import sys
import time
from typing import Any, Iterator

import torch

from lightalign.modules.sampling.vllm import vllm_weights
from lightalign.process_death import died
from lightalign.modules.rollout.offpolicy.bookkeeping import RolloutsAhead, SamplerProcessDied, SamplerProcessError
from lightalign.modules.rollout.offpolicy.worker import ModelSpec, Probe, Reply, Request, serve

START_TIMEOUT = 600.0  # seconds the sampling process may take to import and report ready
COPY_TOLERANCE = 1e-4  # max |log-prob difference| between the policy and its sampling copy (threads, kernels)


def sampling_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the policy's weights for the sampling process, in shared memory, under the base model's names
    (a LoRA policy's adapters merged into them, as they are pushed to vLLM)."""
    return {name: tensor.clone().share_memory_() for name, tensor in vllm_weights(model)}


@torch.no_grad()
def copy_weights(weights: dict[str, torch.Tensor], source: torch.nn.Module) -> None:
    """``source``'s current weights into ``weights`` (a ``sampling_weights`` copy of it), in place."""
    seen = 0
    for name, tensor in vllm_weights(source):
        if name not in weights:
            raise SamplerProcessError(f"The policy's weight {name!r} is not in the sampling copy made at fit start "
                                      "(a module was added during training).")
        weights[name].copy_(tensor)
        seen += 1
    if seen != len(weights):
        raise SamplerProcessError("The policy has fewer weights than the sampling copy made at fit start.")


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (the sampling process builds this class)."""
    from lightalign.modules.training.lora import is_peft_model

    return model.get_base_model() if is_peft_model(model) else model


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """While a process is spawned: the parent's ``__main__`` looks like an interactive session's, so the child does
    not run the parent's script again (the ``lightalign`` console script, a user's unguarded training script)."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    if "__file__" in saved:
        del main.__file__
    if "__spec__" in saved:
        main.__spec__ = None
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(main, key, value)


class AheadSampler(RolloutsAhead):
    """Rollouts ``depth`` ahead in a sampling process with ``threads`` torch threads (see the module docstring)."""

    def __init__(self, depth: int, threads: int) -> None:
        if depth < 1:
            raise ValueError(f"AheadSampler needs depth >= 1, got {depth}.")
        super().__init__()
        self.depth, self.threads = depth, threads
        self.process: Any = None
        self.requests: Any = None
        self.replies: Any = None
        self.slots: list[dict[str, torch.Tensor]] = []  # the weights of each slot, in shared memory

    # ------------------------------------------------------------------------------------- the process
    def start(self, model: torch.nn.Module, tokenizer: Any, backend: str, sampling: dict[str, Any],
              probe: dict[str, Any], precision: str = "32-true") -> None:
        """Start the sampling process on a copy of ``model``'s weights and measure that the copy computes what the
        policy computes on ``probe`` (a prompt batch) under the trainer's ``precision``: refused otherwise, naming the
        difference."""
        context = multiprocessing.get_context("spawn")
        self.slots = [sampling_weights(model) for _ in range(self.depth)]
        base = base_model(model)
        spec = ModelSpec(type(base), base.config, base.generation_config, self.slots)
        self.requests, self.replies = context.Queue(), context.Queue()
        self.process = context.Process(target=serve, name="lightalign-sampler", daemon=True, args=(
            self.requests, self.replies, spec, tokenizer, backend, sampling, self.threads))
        try:
            with main_module_hidden():
                self.process.start()
        except BaseException:
            self.process = None
            raise
        reply = self._next_reply(START_TIMEOUT, "start")
        if reply.kind != "ready":
            raise SamplerProcessError(f"The sampling process did not start:\n{reply.error}")
        self.check_copy(model, probe, precision)

    @torch.no_grad()
    def check_copy(self, model: torch.nn.Module, probe: dict[str, Any], precision: str = "32-true") -> None:
        """The sampling copy's log-probs on the probe prompts equal the policy's (eval mode): a model whose forward
        depends on more than its class, config and weights (a hook, a patched method) is refused here. The sampling
        process computes in its weights' dtype; a policy under autocast (``precision`` ``bf16-mixed``,
        ``16-mixed``) computes in another, and when the policy's forward without autocast matches the copy, the
        refusal names the precision as the difference, with both measured gaps."""
        ids, mask = probe["prompt_input_ids"].cpu(), probe["prompt_attention_mask"].cpu()
        self.requests.put(Probe(ids, mask))
        reply = self._next_reply(START_TIMEOUT, "exactness probe")
        real = mask.bool()
        device = next(model.parameters()).device
        autocast = torch.is_autocast_enabled(device.type)

        def gap_of_policy(autocast_off: bool = False) -> float:
            was_training = model.training
            model.eval()
            try:
                with torch.autocast(device.type, enabled=False) if autocast_off else contextlib.nullcontext():
                    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            finally:
                model.train(was_training)
            mine = torch.log_softmax(logits.float(), -1)
            return float((mine.cpu()[real] - reply.rollout["logps"][real]).abs().max())

        gap = gap_of_policy()
        if not gap <= COPY_TOLERANCE and autocast and (plain := gap_of_policy(autocast_off=True)) <= COPY_TOLERANCE:
            self.close()
            dtype = str(torch.get_autocast_dtype(device.type)).removeprefix("torch.")
            raise SamplerProcessError(
                f"max_staleness > 0: the policy computes under precision {precision} (autocast to {dtype}) and the "
                f"sampling process in its weights' {str(next(model.parameters()).dtype).removeprefix('torch.')}: "
                f"their log-probs differ by {gap:.2e} (max over the first prompts; tolerance {COPY_TOLERANCE:g}; "
                f"{plain:.2e} with the policy's autocast off, so the precision is the whole difference). Set the "
                "trainer's precision: 32-true to sample ahead, or max_staleness: 0 to sample in the policy's "
                "precision.")
        if not gap <= COPY_TOLERANCE:
            self.close()
            raise SamplerProcessError(
                f"max_staleness > 0: the sampling process's copy of {type(base_model(model)).__name__} (rebuilt from "
                f"its class, config and weights) gives log-probs that differ from the policy's by {gap:.2e} (max over "
                f"the first prompts; tolerance {COPY_TOLERANCE:g}): the policy's forward depends on something else "
                "(a forward hook, a patched method). Use max_staleness: 0, or put that change into the model's class.")

    def close(self) -> None:
        """Stop the sampling process (the rollouts in flight are dropped)."""
        if self.process is None:
            return
        try:
            self.requests.put(None)
            self.process.join(timeout=10)
        finally:
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(timeout=10)
            self.process = None
            self.in_flight.clear()

    def _next_reply(self, timeout: float | None, waiting_for: str) -> Reply:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.replies.get(timeout=1.0)
            except queue.Empty:
                pass
            except (EOFError, OSError):  # a reply cut off by the process's death (connection reset, EOF)
                self.process.join(timeout=5.0)
            if not self.process.is_alive():
                raise SamplerProcessDied(died("The sampling process of the asynchronous rollouts", self.process.pid,
                                              self.process.exitcode, f"the run waited for its {waiting_for}"))
            if deadline is not None and time.monotonic() > deadline:
                raise SamplerProcessError(f"The sampling process did not answer within {timeout:.0f} s (waiting for "
                                          f"its {waiting_for}).")

    # ------------------------------------------------------------------------------------- rollouts
    def slot_of(self, index: int) -> int:
        return index % self.depth

    def push(self, slot: int, model: torch.nn.Module) -> None:
        """The policy's current weights into ``slot`` (no rollout in flight may be using it)."""
        if any(self.slot_of(i) == slot for i in self.in_flight):
            raise SamplerProcessError(f"Weight slot {slot} is in use by a rollout in flight: writing it would change "
                                      "weights under a running rollout.")
        copy_weights(self.slots[slot], model)

    def submit(self, index: int, version: int, batch: dict[str, Any], num_generations: int, seed: int) -> None:
        self.in_flight[index] = version
        self.requests.put(Request(index, self.slot_of(index), batch, num_generations, seed))

    def _wait_for(self, index: int) -> None:
        while index not in self.done:
            self._receive()

    def _receive(self) -> None:
        reply = self._next_reply(None, f"rollout {min(self.in_flight)}")
        if reply.kind == "error":
            raise SamplerProcessError(f"Sampling rollout {reply.index} failed in the sampling process:\n{reply.error}")
        version = self.in_flight.pop(reply.index)
        self.done[reply.index] = {"rollout": reply.rollout, "version": version, "seconds": reply.seconds}
