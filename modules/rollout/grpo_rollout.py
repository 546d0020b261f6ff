"""GRPO's rollouts, the part of ``GRPOModule`` that makes what it trains on: sample a group of completions per
prompt, score them (rewards -> advantages), compute the per-token log-probs (and entropies) of the policy, the
rollout's old policy and the reference, and split the rollout into the micro-batches of ``training_step``.

``GRPORollout`` is a mixin of ``GRPOModule`` (``modules/grpo.py``), which owns the knobs, the training step and the
checkpointed state; it reads them through ``self.hparams`` and the module's attributes.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightalign.modules.losses.entropy import token_entropies
from lightalign.modules.generation.sampling import sample_completions, split_rollout
from lightalign.modules.generation.backends import effective_backend, resolve_backend
from lightalign.modules.adaptations.layouts import grpo_forward, packed_completion_batch, prompt_group_batch
from lightalign.modules.training.logprobs import scatter_to_sequences
from lightalign.rewards import (check_reward_weights, clip_rewards, compute_rewards, nanstd, normalize_then_sum,
                                scale_advantages)


class GRPORollout:
    """Sampling, scoring and buffering of GRPO rollouts (mixed into ``GRPOModule``)."""

    def _reuses_rollout(self, steps: int) -> bool:
        """Whether a rollout is trained on by an updated policy (then the old log-probs are needed)."""
        return self.hparams.num_iterations > 1 or steps > self.trainer.accumulate_grad_batches

    @torch.no_grad()
    def generate(self, batch: dict[str, Any], num_generations: int, return_logprobs: bool = False) -> dict[str, Any]:
        """Sample ``num_generations`` completions per prompt (``generation.sample_completions``) on the module's
        generation backend (``generation_backends``); ``return_logprobs`` adds the sampler's ``sampling_logps``. With
        ``use_vllm``: the vLLM engine set up by ``vllm_engines.VLLMRollouts``."""
        if getattr(self, "vllm_generation", None) is not None:
            return self.vllm_generation.sample_completions(self, batch, num_generations)
        return self._sample(batch, num_generations, self.sampling_backend(), return_logprobs)

    def sampling_backend(self) -> str:
        """The generation backend of this run, decided once (at fit start, before any rollout): the asked one, or
        the device's default (``effective_backend``), each measured on a probe of the policy
        (``adaptations.check_layout``: greedy completions equal ``generate`` on each prompt alone). An asked backend,
        or the shared prefill, that is not exact is refused naming the knob; a default that is not exact steps back
        to ``generate``, and the fit-start line says so and why."""
        if getattr(self, "_sampling_backend", None) is not None:
            return self._sampling_backend
        from lightalign.modules.adaptations import describe_decision
        from lightalign.modules.adaptations.support import LayoutRefused, check_layout

        hp = self.hparams
        asked = resolve_backend(hp.get("generation_backend"), hp.get("use_transformers_continuous_batching", False))
        backend, why_not_default = effective_backend(asked, self.model, repetition_penalty=hp.repetition_penalty,
                                                     generation_kwargs=hp.generation_kwargs,
                                                     cache_implementation=hp.cache_implementation)
        how = f"not the device's default: {why_not_default}" if why_not_default else "asked" if asked else "default"
        if backend != "generate":
            try:
                how += ", " + describe_decision(check_layout(self.model, backend))
            except LayoutRefused as refused:
                if asked is not None:
                    raise
                how, backend = f"the default {backend} is not exact on this model: {refused}", "generate"
        if hp.share_prefill and backend == "generate":
            check_layout(self.model, "shared_prefill")  # refused naming model.share_prefill
        self._sampling_backend, self.sampling_note = backend, f"generation {backend} ({how})"
        return backend

    def _sample(self, batch: dict[str, Any], num_generations: int, backend: str, return_logprobs: bool
                ) -> dict[str, Any]:
        hp = self.hparams
        extra = {} if backend == "continuous" else {
            "repetition_penalty": hp.repetition_penalty, **(hp.generation_kwargs or {}),
            **({} if hp.cache_implementation is None else {"cache_implementation": hp.cache_implementation})}
        return sample_completions(
            self.model, self.tokenizer, batch, num_generations, share_prefill=hp.share_prefill, backend=backend,
            continuous_config=hp.get("transformers_continuous_batching_config"), return_logprobs=return_logprobs,
            max_new_tokens=hp.max_completion_length, temperature=hp.temperature, top_p=hp.top_p, top_k=hp.top_k or 0,
            min_p=hp.min_p, **extra,
        )

    def score(self, rollout: dict[str, Any], stats: torch.nn.ModuleDict, num_generations: int | None = None
              ) -> torch.Tensor:
        """Rewards -> (normalised, clipped) -> group-relative advantages; logs the reward statistics."""
        hp = self.hparams
        group = num_generations or hp.num_generations
        per_func, total = compute_rewards(self.reward_funcs, rollout["prompts"], rollout["completions"],
                                          rollout["columns"], hp.reward_weights)
        total = total.to(self.device).float()
        if (~torch.isnan(total)).any():  # a completion no function could score has a NaN total (as in TRL)
            stats[_key("reward/mean")].update(torch.nanmean(total))
            stats[_key("reward/std")].update(nanstd(total))
        for j, name in enumerate(self.reward_names):
            column = per_func[:, j]
            if (~torch.isnan(column)).any():
                stats[_key(f"reward/{name}")].update(torch.nanmean(column.float()))
        lengths = rollout["completion_mask"].sum(-1).float()
        stats[_key("completions/mean_length")].update(lengths.mean())
        stats[_key("completions/clipped_ratio")].update(rollout["truncated"].float().mean())
        self.last_samples = [
            {"step": self.global_step, "prompt": p if isinstance(p, str) else p[-1]["content"], "completion": t,
             "reward": float(r), **{n: float(per_func[i, j]) for j, n in enumerate(self.reward_names)}}
            for i, (p, t, r) in enumerate(zip(rollout["prompts"], rollout["texts"], total.tolist()))
        ]
        if not self.training and (self.eval_metric_objects or self.eval_metric_fns):
            scored = total[~torch.isnan(total)]  # eval_metrics see each scored completion's total reward, and ones
            self.update_eval_metrics(scored, torch.ones_like(scored, dtype=torch.long))
        return self.rewards_to_advantages(per_func, total, group)

    def rewards_to_advantages(self, per_func: torch.Tensor, total: torch.Tensor, group: int) -> torch.Tensor:
        """GRPO's advantages ``[N]`` from each function's rewards ``[N, F]`` and their weighted sum ``[N]``
        (``multi_objective_aggregation``, ``normalize_rewards``, ``reward_clip``, ``scale_rewards``)."""
        hp = self.hparams
        gather = self._trainer is not None and self.trainer.world_size > 1  # statistics over every rank's rewards
        if hp.multi_objective_aggregation == "normalize_then_sum":
            weights = check_reward_weights(self.reward_funcs, hp.reward_weights).to(self.device)
            return normalize_then_sum(per_func.to(self.device), weights, group,
                                      gather=(lambda x: self.all_gather(x).flatten()) if gather else None)
        rewards = total
        if self.reward_normalizer is not None and self.training:
            pool = self.all_gather(rewards).flatten() if gather else None
            rewards = self.reward_normalizer.normalize(rewards, pool=pool)
        rewards = clip_rewards(rewards, hp.reward_clip)
        batch_rewards = None  # "batch" divides by the std of every rank's rewards (TRL gathers them too)
        if hp.scale_rewards == "batch" and gather:
            batch_rewards = self.all_gather(rewards).flatten()
        return scale_advantages(rewards, group, hp.scale_rewards, batch_rewards=batch_rewards)

    def token_logps(self, model: torch.nn.Module, mb: dict[str, Any], with_entropy: bool = False,
                    entropy_grad: bool = False):
        """Per-token log-probs of the completion tokens ``[B, T]`` and, ``with_entropy``, their per-token entropies
        ``[B, T]`` (0 under the completion mask; differentiable only with ``entropy_grad``)."""
        logps, logits, _ = grpo_forward(model, mb, self.hparams.temperature)
        if not with_entropy:
            return logps, None
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropies = token_entropies(logits)
        layout = mb.get("shared", mb.get("packed"))  # [targets] -> [B, T]
        if layout is not None:
            entropies = scatter_to_sequences(entropies, layout, *mb["completion_ids"].shape)[0]
        return logps, torch.where(mb["completion_mask"].bool(), entropies, torch.zeros_like(entropies))

    def next_micro_batch(self, batch: dict[str, Any]) -> tuple[dict[str, torch.Tensor], int]:
        """The buffered micro-batch this training step trains on (a new rollout when the buffer is used up), and
        its slot in the rollout."""
        _, steps, _ = self.rollout_shape
        if self._buffer is None or self._buffer_pos >= steps * self.hparams.num_iterations:
            self._buffer = self._make_rollout(batch)
            self._buffer_pos = 0
        slot = self._buffer_pos % steps
        self._buffer_pos += 1
        if self._buffer[slot]["advantages"].device != self.device:  # restored from a checkpoint (loaded on CPU)
            self._buffer = [move_data_to_device(chunk, self.device) for chunk in self._buffer]
        mb = self._buffer[slot]
        self.last_batch_tokens = int(mb["prompt_mask"].sum() + mb["completion_mask"].sum())
        self.last_batch_samples = int(mb["completion_ids"].shape[0])
        return mb, slot

    @torch.no_grad()
    def _make_rollout(self, batch: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        hp = self.hparams
        gen, steps, _ = self.rollout_shape
        prompts_expected = gen // hp.num_generations
        if len(batch["prompts"]) != prompts_expected:
            raise ValueError(f"Expected {prompts_expected} prompts per rollout (generation_batch_size {gen} / "
                             f"num_generations {hp.num_generations}), got {len(batch['prompts'])}.")
        rollout = self.generate(batch, hp.num_generations)
        self.generation_count += 1
        advantages = self.score(rollout, self.train_stats)
        lengths = rollout["completion_mask"].sum(-1)  # generated tokens through EOS, before any masking
        if hp.mask_truncated_completions:
            rollout["completion_mask"] = rollout["completion_mask"] * (~rollout["truncated"]).long().unsqueeze(-1)
        tensors = {k: rollout[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        tensors["advantages"] = advantages
        tensors["row"] = torch.arange(advantages.shape[0], device=advantages.device)  # the rollout order (groups)
        chunks = split_rollout(tensors, lengths, steps, hp.num_generations, whole_groups=hp.prompt_sharing)
        pad = self.tokenizer.pad_token_id
        for mb in chunks:
            lengths = mb.pop("lengths")
            if hp.prompt_sharing:
                mb["shared"] = prompt_group_batch(mb, pad if pad is not None else 0, hp.pack_length, lengths)
            elif hp.get("padding_free"):
                mb["packed"] = packed_completion_batch(mb, lengths)
        needs_old = self._reuses_rollout(steps)
        for mb in chunks:
            if needs_old:
                mb["old_logps"], _ = self.token_logps(self.model, mb)
            if hp.beta > 0:
                if self.ref_model is not None:
                    mb["ref_logps"], _ = self.token_logps(self.ref_model, mb)
                else:
                    with self.model.disable_adapter():
                        mb["ref_logps"], _ = self.token_logps(self.model, mb)
        return chunks


def _key(name: str) -> str:
    """A metric name as a ``ModuleDict`` key (no dots or slashes)."""
    return name.replace("/", "__").replace(".", "_")
