"""REINFORCE Leave-One-Out: ``RLOOModule`` (TRL 1.16's ``RLOOTrainer`` knobs and formulas) on the online-RL loop.

The loop (sample -> score -> split -> log-probs -> advantages -> buffer) is ``OnlineRLModule``, TRL's rollout
schedule and the training layouts ``CriticFreeModule``. RLOO's part is its advantage and loss (the pure functions
``kl_penalized_rewards``, ``rloo_advantages`` and ``rloo_loss``):

* the KL penalty goes into the reward, per sequence (``beta``, first-order log-ratio summed over the completion);
* each completion's baseline is the mean reward of the other completions of its prompt;
* the loss is PPO's clipped surrogate on the sequence log-probability ratio, averaged over sequences, so
  accumulation and data parallelism give the gradient of one big batch of equal micro-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightalign.knobs import KnobGroup, knob, takes_knobs

from lightalign.modules.losses.advantages import kl_penalized_rewards, rloo_advantages
from lightalign.modules.losses.kl_penalty import KLKnobs
from lightalign.modules.losses.rloo import rloo_loss
from lightalign.modules.rollout.buffer import in_rollout_order, scatter_rows
from lightalign.modules.rollout.critic_free import CriticFreeModule
from lightalign.modules.rollout.scoring import metric_key

__all__ = ["RLOOModule"]


@dataclasses.dataclass(frozen=True)
class RLOOKnobs(KnobGroup):
    """RLOO's own knobs: the clip of its per-completion ratio, its advantage and reward clamp (TRL 1.16's names)."""

    group = "rloo"
    epsilon: float = knob(0.2, "lower clipping range of the *sequence* ratio: clipped below at ``1 - epsilon``.")
    epsilon_high: float | None = knob(None, "upper clipping range of the sequence ratio: clipped above at "
                                            "``1 + epsilon_high``; None: ``epsilon``.")
    normalize_advantages: bool = knob(False, "standardise the advantages over the whole generation batch (every "
                                             "rank's).")
    reward_clip_range: tuple[float, float] | None = knob(None, "``[low, high]`` to clamp the weighted reward to before "
                                                               "the KL penalty; None: no clamp.")

    def check(self) -> None:
        if not self.epsilon > 0:
            raise ValueError(f"epsilon (lower clipping range, ratio >= 1 - epsilon) must be > 0, got {self.epsilon}.")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ValueError(f"epsilon_high must be > 0 or null (= epsilon), got {self.epsilon_high}.")
        low_high = self.reward_clip_range
        if low_high is not None and (len(low_high) != 2 or not float(low_high[0]) < float(low_high[1])):
            raise ValueError(f"reward_clip_range must be [low, high] with low < high, or null; got {list(low_high)}.")


@takes_knobs(KLKnobs, RLOOKnobs, defaults={"num_generations": 2, "beta": 0.05})
class RLOOModule(CriticFreeModule):
    """RLOO on the prompt batches of ``PromptDataModule`` (TRL 1.16's knob names and defaults): at least 2
    completions per prompt, since a completion's baseline is the others' mean; a completion no reward function scores
    (None from every function) is left out of its siblings' baselines and gets advantage 0. The KL penalty (``beta``)
    is taken from each completion's reward before the baselines."""

    method_name = "RLOO"
    takes_images = True  # prompts with images: sampled and scored with them (check_image_prompts)
    uses_reference_model = True
    group_needs = "a completion's baseline is the mean reward of the other completions of its prompt"
    method_stats = ("clip_ratio", "clip_ratio/low", "clip_ratio/high", "kl")

    def check_knob_combinations(self) -> None:
        super().check_knob_combinations()
        mode = self.knobs.importance_sampling.vllm_importance_sampling_mode
        if str(mode).startswith("token_"):
            raise ValueError(f"vllm_importance_sampling_mode={mode!r}: RLOO's loss is one clipped ratio per completion, "
                             "so its importance-sampling weight is per completion too; use 'sequence_mask' or "
                             "'sequence_truncate'.")

    @property
    def uses_reference(self) -> bool:
        return self.hparams.beta > 0

    def needs_old_logps(self) -> bool:
        # the KL penalty needs the sampling policy's log-probs at rollout time
        return self.hparams.beta > 0 or super().needs_old_logps()

    # ------------------------------------------------------------------------------------- advantages
    def rollout_advantages(self, chunks: list[dict[str, torch.Tensor]]) -> None:
        hp = self.hparams
        (rewards,) = in_rollout_order(chunks, "rewards")
        if hp.reward_clip_range is not None:
            rewards = rewards.clamp(*(float(bound) for bound in hp.reward_clip_range))
        if hp.beta > 0:
            mask, old, ref = in_rollout_order(chunks, "completion_mask", "old_logps", "ref_logps")
            rewards, kl = kl_penalized_rewards(rewards, old, ref, mask, hp.beta)
            self.train_stats[metric_key("kl")].update(kl.sum() / mask.sum().clamp(min=1))
        gather = None
        if self._trainer is not None and self.trainer.world_size > 1:
            gather = lambda local: self.all_gather(local).flatten()  # noqa: E731
        scatter_rows(chunks, advantages=rloo_advantages(rewards, hp.num_generations, hp.normalize_advantages,
                                                        gather=gather))

    # ------------------------------------------------------------------------------------- training
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        mb, _ = self.next_micro_batch(batch)
        with self.training_forward_context():
            logps, entropies = self.token_logps(self.model, mb, with_entropy=hp.log_entropy)
        # on-policy (one pass, one optimizer step per rollout) the ratio is 1 by definition: the old log-probs are
        # there only for the KL penalty, and a second forward's rounding (or dropout) must not clip anything
        old = mb.get("old_logps") if self.reuses_rollout() else None
        is_ratio = self.off_policy.importance_ratio(self, mb, logps)  # rollouts sampled ahead / by vLLM
        loss, stats = rloo_loss(logps, old, mb["advantages"], mb["completion_mask"],
                                epsilon=hp.epsilon, epsilon_high=hp.epsilon_high,
                                importance_sampling_ratio=is_ratio)
        s = self.train_stats
        s[metric_key("loss")].update(loss.detach())
        s[metric_key("clip_ratio")].update(stats["clip_ratio/region_mean"])
        s[metric_key("clip_ratio/low")].update(stats["clip_ratio/low_mean"])
        s[metric_key("clip_ratio/high")].update(stats["clip_ratio/high_mean"])
        mask = mb["completion_mask"].bool()
        if entropies is not None and mask.any():
            s[metric_key("entropy")].update(entropies.detach()[mask].mean())
        return self.add_router_aux_loss(loss)
