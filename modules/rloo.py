"""REINFORCE Leave-One-Out: ``RLOOModule`` (TRL 1.16's ``RLOOTrainer`` knobs and formulas).

RLOO shares GRPO's machinery: ``PromptDataModule`` prompts, generation (shared prefill, sampling knobs), the reward
functions, the rollout buffer reused across ``training_step`` calls, exact resume and every strategy. What differs is
the advantage and the loss (the pure functions of ``modules/losses/rloo.py``):

* the KL penalty goes into the reward, per sequence (``beta``, first-order log-ratio summed over the completion);
* each completion's baseline is the mean reward of the other completions of its prompt;
* the loss is PPO's clipped surrogate on the sequence log-probability ratio, averaged over sequences, so
  accumulation and data parallelism give the gradient of one big batch of equal micro-batches.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from lightalign.modules.grpo import GRPOModule
from lightalign.modules.rollout.grpo_rollout import _key
from lightalign.modules.losses.rloo import kl_penalized_rewards, rloo_advantages, rloo_loss

__all__ = ["RLOOModule"]

# GRPO knobs with no meaning here: RLOO fixes its advantage (leave-one-out) and its loss (sequence ratio).
_GRPO_ONLY = ("loss_type", "delta", "importance_sampling_level", "sapo_temperature_pos", "sapo_temperature_neg",
              "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "off_policy_mask_threshold",
              "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max",
              "entropy_coef_delta", "entropy_target", "use_bias_correction_kl", "scale_rewards", "normalize_rewards",
              "reward_clip", "multi_objective_aggregation")


class RLOOModule(GRPOModule):
    """RLOO on the prompt batches of ``PromptDataModule`` (TRL 1.16's knob names and defaults).

    Args:
        reward_funcs, reward_weights: as ``GRPOModule`` (callables, import paths or reward-model folders; the
            reward is their weighted sum; ``None`` from every function marks a completion unscorable: it is left
            out of its siblings' baselines and gets advantage 0).
        num_generations: completions per prompt (the group); at least 2, since the baseline is the others' mean.
        num_generations_eval, generation_batch_size, steps_per_generation, num_iterations, max_completion_length,
            temperature, top_p, top_k, min_p, repetition_penalty, generation_kwargs, cache_implementation,
            mask_truncated_completions, share_prefill, prompt_sharing, pack_length, padding_free, log_entropy: as
            ``GRPOModule``.
        epsilon, epsilon_high: clipping range ``[1 - epsilon, 1 + epsilon_high]`` of the *sequence* ratio.
        beta: KL coefficient (TRL's default 0.05). The penalty ``beta * sum_t (logp_old - logp_ref)`` is taken
            from the reward of each completion before the baselines; a reference model is built when ``beta > 0``
            (a frozen copy, a separately loaded ``ref_model_name_or_path``, or the base model with LoRA disabled).
        normalize_advantages: standardise the advantages over the whole generation batch (every rank's).
        reward_clip_range: ``[low, high]`` to clamp the weighted reward to before the KL penalty; None: no clamp.
        ref_model_name_or_path, ref_model_init_kwargs: a separately loaded reference.
        **kwargs: ``PolicyModule`` arguments (model, LoRA, optimizer, schedule). GRPO's own knobs
            (``loss_type``, ``scale_rewards``, ``entropy_coef``, …), which ``--model.help`` also lists, have no
            meaning here: set to anything but their default they are refused.
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        reward_funcs: list[str | Callable] | str | Callable | None = None,
        reward_weights: list[float] | None = None,
        num_generations: int = 2,
        num_generations_eval: int | None = None,
        generation_batch_size: int | None = None,
        steps_per_generation: int | None = None,
        num_iterations: int = 1,
        max_completion_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        generation_kwargs: dict[str, Any] | None = None,
        cache_implementation: str | None = None,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.05,
        normalize_advantages: bool = False,
        reward_clip_range: tuple[float, float] | None = None,
        mask_truncated_completions: bool = False,
        ref_model_name_or_path: str | None = None,
        ref_model_init_kwargs: dict[str, Any] | None = None,
        log_entropy: bool = True,
        share_prefill: bool = True,
        prompt_sharing: bool = False,
        pack_length: int = 1024,
        padding_free: bool = False,
        **kwargs: Any,
    ) -> None:
        # LightningCLI fills every GRPOModule knob with its default (it follows **kwargs into the parent): only a
        # changed one is refused
        defaults = {n: p.default for n, p in inspect.signature(GRPOModule.__init__).parameters.items()}
        given = sorted(k for k in set(kwargs) & set(_GRPO_ONLY) if kwargs[k] != defaults[k])
        for name in _GRPO_ONLY:
            kwargs.pop(name, None)
        if given:
            raise ValueError(f"{given} are GRPOModule knobs with no meaning in RLOOModule (its advantage is the "
                             "leave-one-out baseline and its loss the clipped sequence ratio); remove them, or use "
                             "GRPOModule.")
        if num_generations < 2:
            raise ValueError(f"RLOOModule needs num_generations >= 2 (a completion's baseline is the mean reward of "
                             f"the other completions of its prompt), got {num_generations}.")
        if beta < 0:
            raise ValueError(f"beta must be >= 0 (the KL penalty's coefficient), got {beta}.")
        if reward_clip_range is not None:
            if len(reward_clip_range) != 2 or not float(reward_clip_range[0]) < float(reward_clip_range[1]):
                raise ValueError(f"reward_clip_range must be [low, high] with low < high, or null; got "
                                 f"{list(reward_clip_range)}.")
            reward_clip_range = (float(reward_clip_range[0]), float(reward_clip_range[1]))
        super().__init__(
            model_name_or_path, reward_funcs=reward_funcs, reward_weights=reward_weights,
            num_generations=num_generations, num_generations_eval=num_generations_eval,
            generation_batch_size=generation_batch_size, steps_per_generation=steps_per_generation,
            num_iterations=num_iterations, max_completion_length=max_completion_length, temperature=temperature,
            top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
            generation_kwargs=generation_kwargs, cache_implementation=cache_implementation, loss_type="grpo",
            epsilon=epsilon, epsilon_high=epsilon_high, beta=beta, scale_rewards="none",
            mask_truncated_completions=mask_truncated_completions, ref_model_name_or_path=ref_model_name_or_path,
            ref_model_init_kwargs=ref_model_init_kwargs, log_entropy=log_entropy, share_prefill=share_prefill,
            prompt_sharing=prompt_sharing, pack_length=pack_length, padding_free=padding_free, **kwargs,
        )
        # LightningCLI hands save_hyperparameters its own config, with GRPO's defaults for the GRPO knobs RLOO sets
        # itself: they are set here again (else GRPO's checks would read loss_type dapo, scale_rewards group).
        knobs = dict(loss_type="grpo", scale_rewards="none", normalize_advantages=normalize_advantages,
                     reward_clip_range=reward_clip_range)
        self.hparams.update(knobs)
        self._hparams_initial.update(knobs)  # what the logger writes to hparams.yaml

    # ------------------------------------------------------------------------------------- rollout
    def rewards_to_advantages(self, per_func: torch.Tensor, total: torch.Tensor, group: int) -> torch.Tensor:
        """The (clamped) weighted rewards; the advantages come in ``_make_rollout``, after the KL penalty."""
        bounds = self.hparams.reward_clip_range
        return total if bounds is None else total.clamp(*bounds)

    def _reuses_rollout(self, steps: int) -> bool:
        # the KL penalty needs the sampling policy's log-probs at rollout time
        return self.hparams.beta > 0 or super()._reuses_rollout(steps)

    @torch.no_grad()
    def _make_rollout(self, batch: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        hp = self.hparams
        chunks = super()._make_rollout(batch)  # "advantages" holds each row's reward until here
        rows = torch.cat([mb["row"] for mb in chunks])
        order = torch.argsort(rows)  # back to the rollout's order, where a prompt's completions are contiguous
        rewards = torch.cat([mb["advantages"] for mb in chunks])[order]
        if hp.beta > 0:
            def rollout_order(key: str) -> torch.Tensor:
                return torch.cat([mb[key] for mb in chunks])[order]
            mask = rollout_order("completion_mask")
            rewards, kl = kl_penalized_rewards(rewards, rollout_order("old_logps"), rollout_order("ref_logps"),
                                               mask, hp.beta)
            self.train_stats[_key("kl")].update(kl.sum() / mask.sum().clamp(min=1))
        gather = None
        if self._trainer is not None and self.trainer.world_size > 1:
            gather = lambda local: self.all_gather(local).flatten()  # noqa: E731
        advantages = rloo_advantages(rewards, hp.num_generations, hp.normalize_advantages, gather=gather)
        for mb in chunks:
            mb["advantages"] = advantages[mb["row"]]
        return chunks

    # ------------------------------------------------------------------------------------- training
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        mb, _ = self.next_micro_batch(batch)
        with self.training_forward_context():
            logps, entropies = self.token_logps(self.model, mb, with_entropy=hp.log_entropy)
        # on-policy (one pass, one optimizer step per rollout) the ratio is 1 by definition: the old log-probs are
        # there only for the KL penalty, and a second forward's rounding (or dropout) must not clip anything
        old = mb.get("old_logps") if GRPOModule._reuses_rollout(self, self.rollout_shape[1]) else None
        loss, stats = rloo_loss(logps, old, mb["advantages"], mb["completion_mask"],
                                epsilon=hp.epsilon, epsilon_high=hp.epsilon_high)
        s = self.train_stats
        s[_key("loss")].update(loss.detach())
        s[_key("clip_ratio")].update(stats["clip_ratio/region_mean"])
        s[_key("clip_ratio/low")].update(stats["clip_ratio/low_mean"])
        s[_key("clip_ratio/high")].update(stats["clip_ratio/high_mean"])
        mask = mb["completion_mask"].bool()
        if entropies is not None and mask.any():
            s[_key("entropy")].update(entropies.detach()[mask].mean())
        return self.add_router_aux_loss(loss)
