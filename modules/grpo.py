"""Group relative policy optimisation: ``GRPOModule``, its knobs and objective on the online-RL loop.

The loop (sample -> score -> split -> log-probs -> advantages -> buffer) is ``OnlineRLModule``, TRL's rollout
schedule and the training layouts ``CriticFreeModule``. GRPO adds its advantage (group-relative rewards:
``scale_advantages``, ``normalize_then_sum``), its loss (the pure function ``grpo_loss``, re-exported here) and the
entropy controls (``high_entropy_mask``, ``EntropyController``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightalign.modules.losses.entropy import SENTINEL, EntropyController, check_entropy_control, high_entropy_mask
from lightalign.modules.losses.grpo import (GRPO_LOSS_TYPES, GRPOLossConfig, check_kl_beta, grpo_loss,
                                           normalises_by_step_tokens)
from lightalign.modules.rollout.buffer import in_rollout_order, scatter_rows
from lightalign.modules.rollout.critic_free import CriticFreeModule
from lightalign.modules.rollout.scoring import metric_key
from lightalign.modules.losses.advantages import (RunningRewardNormalizer, clip_rewards, normalize_then_sum,
                                                  scale_advantages)
from lightalign.rewards import check_reward_weights

__all__ = ["GRPO_LOSS_TYPES", "GRPOModule", "grpo_loss"]

SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


class GRPOModule(CriticFreeModule):
    """GRPO on the prompt batches of ``PromptDataModule`` (TRL's knob names and defaults).

    Args:
        multi_objective_aggregation: ``sum_then_normalize`` (default): weighted sum of the rewards, then
            ``scale_rewards``; ``normalize_then_sum`` (GDPO): each function's rewards are normalised within each
            group (``(r - mean) / (std + 1e-4)``), weighted and summed, and the sum is normalised over the whole
            generation batch (every rank's); ``scale_rewards`` is then not used, and ``normalize_rewards`` /
            ``reward_clip`` (lightalign's, on the summed reward) are refused with it.
        loss_type: ``dapo`` (default) | ``grpo`` | ``bnpo`` | ``dr_grpo`` | ``cispo`` | ``sapo`` | ``luspo`` |
            ``vespo`` | ``gmpo`` (formulas: ``grpo_loss``; GMPO: set ``epsilon: 0.4``, TRL's GMPO default). ``cispo`` needs ``epsilon_high`` (the ratio cap, e.g. 5.0);
            ``luspo`` needs ``importance_sampling_level: sequence``; ``beta > 0`` and ``top_entropy_quantile < 1`` combine with it as in TRL 1.16.0 (each completion's masked token sum, averaged over completions). ``dapo`` divides by the completion
            tokens of each optimizer step's own micro-batches; when ``steps_per_generation`` exceeds
            ``accumulate_grad_batches`` TRL 1.16 divides by the rollout's tokens times ``accumulate / steps``
            (an average over the rollout) instead. Deliberately: each step's gradient is then the token mean of
            exactly the tokens it trains on, whatever the lengths in the rollout's other steps.
        epsilon: lower clipping range: the importance ratio is clipped below at ``1 - epsilon`` (TRL: 0.2); for
            ``gmpo`` the log-ratio at ``-epsilon`` (TRL's GMPO: 0.4).
        epsilon_high: upper clipping range: clipped above at ``1 + epsilon_high``; None: ``epsilon`` (DAPO's
            clip-higher uses e.g. 0.28; ``cispo``'s ratio cap, e.g. 5.0; ``gmpo``'s log-ratio bound).
        delta: two-sided clipping (INTELLECT-2): the unclipped branch uses ``min(ratio, delta)``; > 1, e.g. 4.0.
        importance_sampling_level: ``token`` (default) or ``sequence`` (GSPO: each completion's mean log-ratio,
            one ratio per completion).
        sapo_temperature_pos: SAPO's gate temperature for tokens with a positive advantage (> 0).
        sapo_temperature_neg: SAPO's gate temperature for the other tokens (> 0).
        vespo_k_pos: VESPO's Gamma weight ``w^k exp(-lambda w)``: ``k`` for non-negative advantages.
        vespo_lambda_pos: VESPO's ``lambda`` for non-negative advantages.
        vespo_k_neg: VESPO's ``k`` for negative advantages.
        vespo_lambda_neg: VESPO's ``lambda`` for negative advantages.
        off_policy_mask_threshold: drop completions with a negative advantage whose mean ``log pi_old - log pi``
            exceeds it (DeepSeek-V3.2). Only acts when the rollout is reused (``num_iterations > 1`` or
            ``steps_per_generation > accumulate_grad_batches``); otherwise the policy is the sampler.
        top_entropy_quantile: keep in the policy term only the tokens whose entropy is in the top quantile of the
            micro-batch's tokens (every rank's); 1.0 keeps all, the paper uses 0.2. The KL term keeps every token.
        entropy_coef: entropy bonus ``loss -= entropy_coef * mean token entropy`` (of the kept tokens).
        use_adaptive_entropy: adaptive entropy control (Skywork-OR1): after each optimizer step ``entropy_coef``
            moves by ``entropy_coef_delta`` (up while the step's mean entropy is <= ``entropy_target``, else down,
            within [``entropy_coef_min``, ``entropy_coef_max``]) and applies only while the last step's entropy is
            <= ``entropy_target``. Its state is in the checkpoint.
        entropy_coef_min: the adaptive coefficient's floor.
        entropy_coef_max: the adaptive coefficient's ceiling.
        entropy_coef_delta: the adaptive coefficient's change per optimizer step.
        entropy_target: the mean token entropy the adaptive control steers towards.
        beta: KL coefficient (k3 estimator) against a reference model, which is built only when ``beta > 0``.
        use_bias_correction_kl: multiply the k3 term by the importance ratio (DeepSeek-V3.2's unbiased estimate;
            on by default, as in TRL 1.16; no effect when ``beta`` is 0).
        scale_rewards: advantage scaling: ``group`` std, ``batch`` std, or ``none``.
        normalize_rewards: normalise rewards by their running mean/std before the advantages (statistics of
            the whole generation batch, every rank's, so all ranks keep the same ones).
        reward_clip: clip (normalised) rewards to ``[-reward_clip, reward_clip]``.
        **kwargs: ``CriticFreeModule`` arguments (``steps_per_generation``, ``num_iterations``, the layouts),
            ``OnlineRLModule`` ones (rewards, ``num_generations``, sampling, reference, vLLM) and ``PolicyModule``
            ones (model, LoRA, optimizer, schedule).
    """

    method_name = "GRPO"
    uses_reference_model = True
    method_stats = ("clip_ratio", "clip_ratio/low", "clip_ratio/high", "kl", "policy_loss", "entropy_coef",
                    "vespo/phi_seq_mean")
    _unregistered_attributes = CriticFreeModule._unregistered_attributes | {"entropy_control"}

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        loss_type: Literal["dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo", "gmpo"] = "dapo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        importance_sampling_level: Literal["token", "sequence"] = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        off_policy_mask_threshold: float | None = None,
        top_entropy_quantile: float = 1.0,
        entropy_coef: float = 0.0,
        use_adaptive_entropy: bool = False,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
        entropy_coef_delta: float = 0.005,
        entropy_target: float = 0.2,
        beta: float = 0.0,
        use_bias_correction_kl: bool = True,
        scale_rewards: Literal["group", "batch", "none"] = "group",
        normalize_rewards: bool = False,
        reward_clip: float | None = None,
        multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize",
        **kwargs: Any,
    ) -> None:
        loss_config = GRPOLossConfig.from_values(locals())  # the loss knobs, checked once, here
        check_kl_beta(beta)
        check_entropy_control(entropy_coef, use_adaptive_entropy, entropy_coef_min, entropy_coef_max,
                              entropy_coef_delta, entropy_target, top_entropy_quantile)
        check_reward_shaping(scale_rewards, normalize_rewards, reward_clip, multi_objective_aggregation)
        super().__init__(model_name_or_path, **kwargs)
        self.loss_config = loss_config
        self.reward_normalizer = RunningRewardNormalizer() if normalize_rewards else None
        self.entropy_control = EntropyController(entropy_coef, use_adaptive_entropy, entropy_target, entropy_coef_delta,
                                                 entropy_coef_min, entropy_coef_max)

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


def check_reward_shaping(scale_rewards: str, normalize_rewards: bool, reward_clip: float | None,
                         multi_objective_aggregation: str) -> None:
    """GRPO's reward-to-advantage knobs, checked at construction."""
    if multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation={multi_objective_aggregation!r} is unknown; use one of "
                         f"{list(MULTI_OBJECTIVE_AGGREGATIONS)}.")
    if multi_objective_aggregation == "normalize_then_sum" and (
            normalize_rewards or reward_clip is not None or scale_rewards == "none"):
        raise ValueError("multi_objective_aggregation='normalize_then_sum' normalises each reward function per "
                         "group and the weighted sum over the batch itself: unset normalize_rewards and "
                         "reward_clip, and leave scale_rewards at 'group' (it is not used; 'none' would be "
                         "silently ignored).")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards='{scale_rewards}' is unknown; use one of {list(SCALE_REWARDS)}.")
    if reward_clip is not None and reward_clip <= 0:
        raise ValueError(f"reward_clip must be a positive number or null, got {reward_clip}.")
