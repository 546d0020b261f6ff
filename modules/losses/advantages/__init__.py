"""Advantages in one place: each estimator registered by name (``registry.advantage_estimator``): ``grpo``
(group-relative, ``scale_advantages``), ``gdpo`` (per-function group normalisation, ``normalize_then_sum``),
``rloo`` (leave-one-out baselines, ``rloo_advantages``) and ``gae`` (generalised advantage estimation), with the
reward shaping before them (clipping, running normalisation, RLOO's and PPO's KL-penalised rewards) and the
statistics they use (``nanstd``, ``whiten``)."""

from lightalign.modules.losses.advantages.gae import gae, masked_mean, masked_var, token_rewards, whiten
from lightalign.modules.losses.advantages.group import (SCALE_REWARDS, nanstd, normalize_then_sum, scale_advantages,
                                                        zero_std_fraction)
from lightalign.modules.losses.advantages.leave_one_out import kl_penalized_rewards, rloo_advantages
from lightalign.modules.losses.advantages.reward_shaping import (MissingEOSKnobs, RunningRewardNormalizer,
                                                                 apply_missing_eos_penalty, clip_rewards)

__all__ = ["SCALE_REWARDS", "MissingEOSKnobs", "RunningRewardNormalizer", "apply_missing_eos_penalty", "clip_rewards",
           "gae", "kl_penalized_rewards", "masked_mean", "masked_var", "nanstd", "normalize_then_sum",
           "rloo_advantages", "scale_advantages", "token_rewards", "whiten", "zero_std_fraction"]
