"""Group relative policy optimisation: ``GRPOModule``, its knobs and objective on the online-RL loop.

The loop (sample -> score -> split -> log-probs -> advantages -> buffer) is ``OnlineRLModule``, TRL's rollout
schedule and the training layouts ``CriticFreeModule``. GRPO adds its advantage (group-relative rewards:
``scale_advantages``, ``normalize_then_sum``), its loss (the pure function ``grpo_loss``, re-exported here) and the
entropy controls (``high_entropy_mask``, ``EntropyController``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightalign.knobs import takes_knobs
from lightalign.modules.losses.advantages.reward_shaping import RewardShapingKnobs
from lightalign.modules.losses.entropy import SENTINEL, EntropyController, EntropyKnobs, high_entropy_mask
from lightalign.modules.losses.grpo import GRPO_LOSS_TYPES, GRPOLossConfig, grpo_loss, normalises_by_step_tokens
from lightalign.modules.losses.kl_penalty import KLKnobs
from lightalign.modules.rollout.buffer import in_rollout_order, scatter_rows
from lightalign.modules.rollout.critic_free import CriticFreeModule
from lightalign.modules.rollout.scoring import metric_key
from lightalign.modules.losses.advantages import (RunningRewardNormalizer, clip_rewards, normalize_then_sum,
                                                  scale_advantages)
from lightalign.rewards import check_reward_weights

__all__ = ["GRPO_LOSS_TYPES", "GRPOModule", "grpo_loss"]


@takes_knobs(GRPOLossConfig, KLKnobs, EntropyKnobs, RewardShapingKnobs)
class GRPOModule(CriticFreeModule):
    """GRPO on the prompt batches of ``PromptDataModule`` (TRL's knob names and defaults): the loss
    (``GRPOLossConfig``, a registered policy loss per ``loss_type``), the KL term (``KLKnobs``), the entropy bonus and
    mask (``EntropyKnobs``) and the rewards' way to advantages (``RewardShapingKnobs``), on the critic-free loop."""

    method_name = "GRPO"
    takes_images = True  # prompts with images: sampled and scored with them (check_image_prompts)
    uses_reference_model = True
    method_stats = ("clip_ratio", "clip_ratio/low", "clip_ratio/high", "kl", "policy_loss", "entropy_coef",
                    "vespo/phi_seq_mean")
    _unregistered_attributes = CriticFreeModule._unregistered_attributes | {"entropy_control"}

    def compose(self) -> None:
        super().compose()
        entropy = self.knobs.entropy
        self.loss_config = self.knobs.loss
        self.reward_normalizer = RunningRewardNormalizer() if self.knobs.reward_shaping.normalize_rewards else None
        self.entropy_control = EntropyController(entropy.entropy_coef, entropy.use_adaptive_entropy,
                                                 entropy.entropy_target, entropy.entropy_coef_delta,
                                                 entropy.entropy_coef_min, entropy.entropy_coef_max)

    @property
    def uses_reference(self) -> bool:
        return self.hparams.beta > 0

    # ------------------------------------------------------------------------------------- setup
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        steps, accumulate = self.micro_batches_per_rollout(), self.trainer.accumulate_grad_batches
        if normalises_by_step_tokens(self.hparams.loss_type) and steps % accumulate:
            raise ValueError(
                f"loss_type='{self.hparams.loss_type}' normalises by the completion tokens of each optimizer step, so "
                f"an optimizer step must not straddle two rollouts: steps_per_generation ({steps}) must be a multiple "
                f"of accumulate_grad_batches ({accumulate})."
            )
        if self.hparams.off_policy_mask_threshold is not None and not self.reuses_rollout():
            rank_zero_warn("off_policy_mask_threshold has no effect here: every rollout is trained on once, by the "
                           "policy that sampled it (num_iterations=1, steps_per_generation <= accumulate_grad_batches).")

    # ------------------------------------------------------------------------------------- advantages
    def rollout_advantages(self, chunks: list[dict[str, torch.Tensor]]) -> None:
        per_func, total = in_rollout_order(chunks, "reward_parts", "rewards")
        scatter_rows(chunks, advantages=self.advantages_from_rewards(per_func, total, self.hparams.num_generations))

    def advantages_from_rewards(self, per_func: torch.Tensor, total: torch.Tensor, group: int) -> torch.Tensor:
        """GRPO's advantages ``[N]`` from each function's rewards ``[N, F]`` and their weighted sum ``[N]``
        (``multi_objective_aggregation``, ``normalize_rewards``, ``reward_clip``, ``scale_rewards``)."""
        hp = self.hparams
        gather = self._trainer is not None and self.trainer.world_size > 1  # statistics over every rank's rewards
        if hp.multi_objective_aggregation == "normalize_then_sum":
            weights = check_reward_weights(self.reward_funcs, self.reward_weights).to(self.device)
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

    # ------------------------------------------------------------------------------------- training
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        mb, slot = self.next_micro_batch(batch)
        control = self.entropy_control
        with self.training_forward_context():
            logps, entropies = self.token_logps(self.model, mb, entropy_grad=control.enabled,
                                                with_entropy=hp.log_entropy or control.enabled or hp.top_entropy_quantile < 1)
        is_ratio = self.off_policy.importance_ratio(self, mb, logps)  # rollouts sampled ahead / by vLLM
        mask = mb["completion_mask"].bool()
        entropy_mask = None if hp.top_entropy_quantile >= 1 else self._high_entropy_mask(entropies.detach(), mask)
        num_items, scale = None, 1.0
        if normalises_by_step_tokens(hp.loss_type):
            num_items, scale = self.step_tokens(slot), float(self.trainer.accumulate_grad_batches)
        loss, stats = grpo_loss(
            logps, mb.get("old_logps"), mb["advantages"], mb["completion_mask"], config=self.loss_config,
            beta=hp.beta, ref_per_token_logps=mb.get("ref_logps"), max_completion_length=hp.max_completion_length,
            num_items_in_batch=num_items, entropy_mask=entropy_mask,
            entropies=entropies if control.enabled else None, entropy_coef=control.applied_coef(),
            loss_scale=scale, importance_sampling_ratio=is_ratio,
            sampling_per_token_logps=mb.get("sampling_logps"),
        )
        if control.enabled:
            selected = mask if entropy_mask is None else entropy_mask
            control.observe((entropies.detach() * selected).sum(), selected.sum())
        s = self.train_stats
        s[metric_key("loss")].update(loss.detach())
        for name, key in (("clip_ratio", "clip_ratio/region_mean"), ("clip_ratio/low", "clip_ratio/low_mean"),
                          ("clip_ratio/high", "clip_ratio/high_mean"), ("kl", "kl"), ("policy_loss", "policy_loss"),
                          ("vespo/phi_seq_mean", "vespo/phi_seq_mean")):
            if key in stats:
                s[metric_key(name)].update(stats[key])
        if entropies is not None and mask.any():
            s[metric_key("entropy")].update(entropies.detach()[mask].mean())
        return self.add_router_aux_loss(loss * scale)

    def _high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``top_entropy_quantile``'s token mask; the quantile is over every rank's real tokens of this step."""
        pool = None
        if self.trainer.world_size > 1:
            local = entropies[mask].float()
            longest = int(self.all_gather(torch.tensor(local.numel(), device=local.device)).max())
            padded = torch.full((longest,), SENTINEL, device=local.device)
            padded[: local.numel()] = local
            pool = self.all_gather(padded).flatten()
        return high_entropy_mask(entropies, mask, self.hparams.top_entropy_quantile, pool=pool)

    def before_step_stats(self) -> None:
        control = self.entropy_control
        if control.enabled:  # the adaptive update takes effect from the next optimizer step on (as TRL)
            world = self.trainer.world_size
            control.step((lambda x: self.trainer.strategy.reduce(x.to(self.device), reduce_op="sum").cpu())
                         if world > 1 else None)
            self.train_stats[metric_key("entropy_coef")].update(torch.tensor(control.coef, device=self.device))

    # ------------------------------------------------------------------------------------- state
    def method_state(self) -> dict[str, Any]:
        return {"entropy_control": self.entropy_control.state_dict()}

    def load_method_state(self, state: dict[str, Any]) -> None:
        if "entropy_control" in state:  # the same on every rank (its window is reduced over ranks)
            self.entropy_control.load_state_dict(state["entropy_control"])

    def rank_state(self) -> dict[str, Any]:
        state = super().rank_state()
        if self.reward_normalizer is not None:
            state["reward_normalizer"] = self.reward_normalizer.state_dict()
        return state

    def load_rank_state(self, state: dict[str, Any]) -> None:
        if self.reward_normalizer is not None and "reward_normalizer" in state:
            self.reward_normalizer.load_state_dict(state["reward_normalizer"])
