"""``OffPolicyRollouts``: the component every online-RL method composes (``OnlineRLModule`` builds it) to train on
rollouts its policy did not sample itself (vLLM; or, in GRPO and RLOO, a sampler running ahead on older weights,
``max_staleness``) and to correct for it.

Its stages in the online-RL loop (``OnlineRLModule``): ``sample`` gives the rollout, with the sampler's
own per-token log-probs (``sampling_logps``) whenever the sampler is not the policy; in each training step
``importance_ratio`` compares them with the policy's (logged as ``sampling/*``) and, with
``vllm_importance_sampling_correction``, gives the importance-sampling ratio the method's loss multiplies its policy
term by (GRPO, RLOO and PPO: ``modules/losses/``). With ``max_staleness: 0`` and no vLLM nothing here runs: the
rollout is sampled by the policy, as in the synchronous loop.
"""

from __future__ import annotations

import dataclasses

from lightalign.knobs import KnobGroup, knob

import os
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info

from lightalign.modules.sampling.completions import eos_token_ids
from lightalign.modules.sampling.vllm_engines import push_weights
from lightalign.modules.rollout.offpolicy.ahead import AheadSampler
from lightalign.modules.losses.importance_sampling import (importance_sampling_ratio,
                                                    sampling_mismatch)
from lightalign.modules.rollout.offpolicy.engine_ahead import EngineAhead
from lightalign.modules.rollout.scoring import metric_key

MISMATCH_STATS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max", "sampling/kl")
RATIO_STATS = ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
               "sampling/importance_sampling_ratio/max", "sampling/importance_sampling_ratio/out_of_bounds")
AHEAD_STATS = ("sampling/staleness", "sampling/wait_seconds")


def update_mismatch_stats(stats: Any, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor,
                          mask: torch.Tensor) -> None:
    """Update ``MISMATCH_STATS`` in ``stats`` (a ``StatMetrics``) with how far the sampler's log-probs of its tokens
    are from the trainer's (``correction.sampling_mismatch``)."""
    mismatch = sampling_mismatch(trainer_logps, sampler_logps, mask)
    for name, key in zip(MISMATCH_STATS, ("logp_difference_mean", "logp_difference_max", "kl")):
        stats[metric_key(name)].update(mismatch[key])


def optimizer_steps_per_rollout(micro_batches: int, passes: int, accumulate: int) -> int | None:
    """Optimizer steps one rollout trains (None when a step straddles two rollouts)."""
    calls = micro_batches * passes
    return calls // accumulate if calls % accumulate == 0 else None


@dataclasses.dataclass(frozen=True)
class AsyncRolloutKnobs(KnobGroup):
    """Rollouts sampled ahead by a sampling process, on weights at most ``max_staleness`` optimizer steps old."""

    group = "async_rollouts"
    max_staleness: int = knob(
        0, "asynchronous rollouts: with it > 0 a sampling process samples the next rollouts while the current one "
           "trains, on a copy of the policy's weights at most ``max_staleness`` optimizer steps old (as many rollouts "
           "ahead as fit: ``max_staleness`` // optimizer steps per rollout; at least one). Each rollout keeps its "
           "sampler's log-probs, and the loss is corrected by the importance-sampling ratio "
           "(``vllm_importance_sampling_*``). 0: each rollout is sampled by the policy that trains on it "
           "(synchronous). With ``use_vllm`` and ``vllm_mode: server`` the vLLM server samples instead, one rollout "
           "ahead (it holds one set of weights, pushed between rollouts). Seeded runs are reproducible and resume "
           "exactly (rollouts in flight are kept in the checkpoint); docs/async.md.")
    async_sampler_threads: int | None = knob(
        None, "torch threads of the sampling process (the training process keeps the rest of its threads); default "
              "half of them. Only with ``max_staleness > 0`` and without vLLM.")

    def check(self) -> None:
        max_staleness, threads = self.max_staleness, self.async_sampler_threads
        if not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0 (optimizer steps the sampler's weights may lag "
                             f"the policy; 0: synchronous rollouts), got {max_staleness!r}.")
        if threads is not None:
            if threads < 1:
                raise ValueError(f"async_sampler_threads must be >= 1 or null, got {threads}.")
            if max_staleness == 0:
                raise ValueError("async_sampler_threads sets the threads of the sampling process, which runs only "
                                 "with max_staleness > 0; set max_staleness or drop async_sampler_threads.")

class OffPolicyRollouts:
    """Asynchronous rollouts (``max_staleness``, ``async_sampler_threads``: described in ``CriticFreeModule``'s
    docstring, the methods that sample ahead) and the importance-sampling correction (``vllm_importance_sampling_*``:
    described in ``OnlineRLModule``'s, every online-RL method). ``OnlineRLModule.__init__`` builds it."""

    def __init__(self, max_staleness: int = 0, async_sampler_threads: int | None = None, correction: bool = True,
                 mode: str = "sequence_mask", clip_min: float | None = None, clip_max: float | None = 3.0) -> None:
        self.max_staleness, self.sampler_threads = max_staleness, async_sampler_threads
        self.correction, self.mode, self.clip_min, self.clip_max = correction, mode, clip_min, clip_max
        self.ahead: AheadSampler | None = None
        self.trainer_threads: int | None = None  # the training process's torch threads before the split
        self.loaded_state: dict[str, Any] = {}
        self.sampled_seconds = 0.0  # the sampling process's seconds on the last rollout taken

    # ------------------------------------------------------------------------------------- what runs
    def sampler_is_stale(self, module: Any) -> bool:
        """Whether rollouts are sampled by something other than the policy being trained."""
        return self.max_staleness > 0 or bool(module.hparams.use_vllm)

    def stat_names(self, use_vllm: bool) -> tuple[str, ...]:
        if not (use_vllm or self.max_staleness):
            return ()
        return (*MISMATCH_STATS, *(RATIO_STATS if self.correction else ()),
                *(AHEAD_STATS if self.max_staleness else ()))

    def depth(self, module: Any) -> int:
        """Rollouts sampled ahead: as many as fit in ``max_staleness`` optimizer steps."""
        steps = optimizer_steps_per_rollout(module.micro_batches_per_rollout(), module.passes(),
                                            module.trainer.accumulate_grad_batches)
        return self.max_staleness // steps

    def check_setup(self, module: Any) -> None:
        """Refuse, at fit start, an asynchronous setting this run cannot honour."""
        if not self.max_staleness:
            return
        name = type(module).__name__
        steps = optimizer_steps_per_rollout(module.micro_batches_per_rollout(), module.passes(),
                                            module.trainer.accumulate_grad_batches)
        if steps is None:
            raise ValueError(f"{name}: max_staleness counts optimizer steps, so a rollout must train whole optimizer "
                             f"steps: steps_per_generation x num_iterations ({module.micro_batches_per_rollout()} x "
                             f"{module.passes()}) must be a multiple of accumulate_grad_batches "
                             f"({module.trainer.accumulate_grad_batches}).")
        if self.max_staleness < steps:
            raise ValueError(f"{name}: max_staleness={self.max_staleness} is less than the {steps} optimizer steps one "
                             f"rollout trains, so no rollout can be sampled ahead; set max_staleness >= {steps} (one "
                             "rollout ahead) or 0 (synchronous).")
        if module.hparams.use_vllm and module.hparams.vllm_mode != "server":
            raise ValueError(f"{name}: max_staleness > 0 with use_vllm samples ahead on a vLLM server (vllm_mode: "
                             "server) while the policy trains; a colocated engine shares the training process's GPU. "
                             "Set vllm_mode: server, or max_staleness: 0.")
        if module.hparams.use_vllm and self.sampler_threads is not None:
            raise ValueError(f"{name}: async_sampler_threads sets the threads of the sampling process that runs "
                             "without vLLM; with use_vllm the vLLM server samples: drop async_sampler_threads.")
        precision = str(getattr(module.trainer, "precision", ""))
        if "mixed" in precision and not module.hparams.use_vllm:
            raise ValueError(f"{name}: max_staleness > 0 samples in a separate process that computes in the weights' "
                             f"float32, while trainer.precision {precision} runs the policy under autocast: the "
                             "rollouts would not be the policy's (their log-probs differ by the precision's rounding). "
                             "Set trainer.precision: 32-true to sample ahead, or model.max_staleness: 0 to sample in "
                             "the policy's precision.")
        if module.tool_rollouts is not None:
            raise ValueError(f"{name}: max_staleness > 0 is not available with tools or environment_factory (tool "
                             "calls run in the training process between sampled turns); set max_staleness: 0.")
        strategy = type(module.trainer.strategy).__name__
        if "FSDP" in strategy or "DeepSpeed" in strategy:
            raise ValueError(f"{name}: max_staleness > 0 keeps a full copy of the policy in a sampling process, which "
                             f"a sharded strategy ({strategy}) does not have; use ddp or a single device, or "
                             "max_staleness: 0.")

    def thread_split(self) -> tuple[int, int]:
        """(sampling process, training process) torch threads: ``async_sampler_threads`` (default half) and the
        rest, at least one each."""
        total = torch.get_num_threads() if self.trainer_threads is None else self.trainer_threads
        threads = self.sampler_threads or max(1, total // 2)
        return threads, max(1, total - threads)

    def note(self, module: Any) -> str | None:
        """The fit-start line saying how rollouts are sampled ahead (None: synchronous)."""
        if not self.max_staleness:
            return None
        steps = optimizer_steps_per_rollout(module.micro_batches_per_rollout(), module.passes(),
                                            module.trainer.accumulate_grad_batches)
        if module.external_sampler is not None or module.hparams.use_vllm:
            return (f"asynchronous rollouts: the vLLM server samples 1 rollout ahead ({steps} optimizer step(s) old; "
                    f"max_staleness {self.max_staleness})")
        depth = self.depth(module)
        sampler, trainer = self.thread_split()
        return (f"asynchronous rollouts: {depth} rollout(s) ahead, at most {depth * steps} optimizer step(s) old "
                f"(max_staleness {self.max_staleness}); a sampling process with {sampler} torch thread(s), training "
                f"keeps {trainer} (async_sampler_threads); it starts with the first rollout")

    # ------------------------------------------------------------------------------------- sample
    def sample(self, module: Any, batch: dict[str, Any]) -> dict[str, Any]:
        """This step's rollout: sampled now by the policy, or taken from the sampler ahead. Rollouts sampled ahead
        are numbered by their place in the training loader's order (epoch, batch), so the prompts asked for ahead
        are the ones the loader hands out when their turn comes, also in a run resumed or fitted again."""
        num_generations = module.hparams.num_generations
        if not self.max_staleness:  # sampled now: by the policy, or by vLLM with the sampler's log-probs
            if self.sampler_is_stale(module):
                return module.generate(batch, num_generations, return_logprobs=True)
            return module.generate(batch, num_generations)
        trainer = module.trainer
        index = trainer.datamodule.rollout_index(trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx)
        ahead = self._started(module, batch)
        depth, step = ahead.depth, module.global_step
        if index not in ahead.pending():  # nothing asked for yet: this rollout and the next `depth`, today's weights
            ahead.drain()
            ahead.done.clear()  # (a checkpoint's rollouts for other indices: not this run's schedule)
            for slot in range(depth):
                ahead.push(slot, module.model)
            for i in range(index, index + depth + 1):
                self._submit(module, ahead, i, step)
        rollout, version, self.sampled_seconds = ahead.take(index)
        if index + depth not in ahead.pending():  # rollout `index` is done with its slot: the next one's weights
            ahead.push(ahead.slot_of(index + depth), module.model)
            self._submit(module, ahead, index + depth, step)
        if step - version > self.max_staleness:
            raise RuntimeError(f"Rollout {index} was sampled with the weights of optimizer step {version} and trains "
                               f"from step {step}: {step - version} steps old, more than max_staleness "
                               f"({self.max_staleness}).")
        check_same_prompts(batch, rollout, num_generations, index)
        stats = module.train_stats
        stats[metric_key("sampling/staleness")].update(torch.tensor(float(step - version)))
        stats[metric_key("sampling/wait_seconds")].update(torch.tensor(ahead.waited))
        ahead.waited = 0.0
        return move_data_to_device(rollout, module.device)

    def _submit(self, module: Any, ahead: AheadSampler, index: int, step: int) -> None:
        seed = int(torch.randint(0, 2**31 - 1, ()))  # the run's RNG: a seeded run samples alike, resumed or not
        batch = module.trainer.datamodule.rollout_prompts(index)
        ahead.submit(index, step, batch, module.hparams.num_generations, seed)

    def _started(self, module: Any, probe: dict[str, Any]) -> AheadSampler | EngineAhead:
        """The sampler ahead, started on first use: the vLLM server's (one rollout ahead, ``EngineAhead``), or a
        sampling process: ``async_sampler_threads`` (default half) of the training process's torch threads go to
        it, the training process keeps the rest until ``close``."""
        if self.ahead is None and module.external_sampler is not None:  # use_vllm, vllm_mode: server
            sampler = module.external_sampler

            def push() -> None:  # weights change only with optimizer steps: one push per step at most
                if sampler.pushed_step != module.global_step:
                    push_weights(sampler, module.trainer, module)

            if self.depth(module) > 1:
                rank_zero_info(f"max_staleness={self.max_staleness} allows {self.depth(module)} rollouts ahead; the "
                               "vLLM server holds one set of weights, so it samples one rollout ahead "
                               "(docs/async.md).")
            self.ahead = EngineAhead(sampler, push, module.tokenizer, eos_token_ids(module.model, module.tokenizer),
                                     module.sampling.sampling_kwargs())
            self.ahead.load_state_dict(self.loaded_state)
        if self.ahead is None:
            threads, trainer_threads = self.thread_split()
            self.ahead = AheadSampler(self.depth(module), threads)
            self.ahead.load_state_dict(self.loaded_state)
            self.trainer_threads = torch.get_num_threads()
            torch.set_num_threads(trainer_threads)
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the tokenizer crosses into a new process
            self.ahead.start(module.model, module.tokenizer, module.sampling_backend(),
                             module.sampling.sampling_kwargs(), probe=probe,
                             precision=str(module.trainer.precision))
        return self.ahead

    def close(self) -> None:
        """Stop the sampling process and give the training process its threads back; the rollouts asked for are
        dropped (a later fit of the same module starts its own)."""
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None
        self.loaded_state = {}
        if self.trainer_threads is not None:
            torch.set_num_threads(self.trainer_threads)
            self.trainer_threads = None

    # ------------------------------------------------------------------------------------- correct
    def importance_ratio(self, module: Any, mb: dict[str, torch.Tensor], logps: torch.Tensor) -> torch.Tensor | None:
        """The micro-batch's importance-sampling ratio (``vllm_importance_sampling_*``) of the policy's log-probs
        over the sampler's, or None (the sampler is the policy, or the correction is off); the mismatch is logged
        either way. The policy's log-probs are the rollout's ``old_logps`` when the rollout is reused (several
        passes or optimizer steps), else this forward's own (detached): the policy has not moved since the
        rollout started training, so no second forward is needed."""
        if not self.sampler_is_stale(module):
            return None
        mask, sampler = mb["completion_mask"], mb["sampling_logps"]
        policy = mb["old_logps"] if "old_logps" in mb else logps.detach()
        stats = module.train_stats
        update_mismatch_stats(stats, policy, sampler, mask)
        if not self.correction:
            return None
        ratio, ratio_stats = importance_sampling_ratio(policy, sampler, mask, self.mode, self.clip_min, self.clip_max)
        for name in ("min", "mean", "max"):
            stats[metric_key(f"sampling/importance_sampling_ratio/{name}")].update(ratio_stats[f"ratio_{name}"])
        stats[metric_key("sampling/importance_sampling_ratio/out_of_bounds")].update(
            ratio_stats["out_of_bounds_fraction"])
        return ratio

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        if self.ahead is None:
            return dict(self.loaded_state)
        return self.ahead.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kept = state.get("ahead_rollouts", {})
        if kept and not self.max_staleness:
            rank_zero_info(f"The checkpoint holds {len(kept)} rollout(s) sampled ahead; with max_staleness 0 every "
                           "rollout is sampled by the policy that trains on it, so they are dropped.")
            kept = {}
        self.loaded_state = {"ahead_rollouts": kept}
        if self.ahead is not None:
            self.ahead.load_state_dict(self.loaded_state)


def check_same_prompts(batch: dict[str, Any], rollout: dict[str, Any], num_generations: int, index: int) -> None:
    """The rollout sampled ahead is for the prompts the training loader hands this step (never silently other)."""
    expected = [p for p in batch["prompts"] for _ in range(num_generations)]
    if rollout["prompts"] != expected:
        raise RuntimeError(f"The rollout sampled ahead for rollout {index} has other prompts than the training loader "
                           "gives this step: the prompt order was changed outside PromptDataModule (a custom loader "
                           "or sampler); set max_staleness: 0.")


class CloseSampler(L.Callback):
    """Stops the sampling process when the fit ends or fails."""

    def __init__(self, off_policy: OffPolicyRollouts) -> None:
        self.off_policy = off_policy

    def on_fit_end(self, trainer: L.Trainer, module: Any) -> None:
        self.off_policy.close()

    def on_exception(self, trainer: L.Trainer, module: Any, exception: BaseException) -> None:
        self.off_policy.close()
