"""``GRPOModule``'s knobs checked together at construction, before any model loads: each refusal names the knob and
what to use instead. (The rollout arithmetic is ``check_rollout_config``, which RLOO and PPO override; reward
functions are resolved by the module.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lightalign.modules.losses.entropy import check_entropy_control
from lightalign.modules.generation.sampling import check_generation_knobs
from lightalign.modules.generation.backends import check_backend_knobs, resolve_backend
from lightalign.modules.losses.grpo import validate_grpo_loss_config
from lightalign.modules.generation.vllm import check_vllm_knobs

SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def check_grpo_knobs(knobs: dict[str, Any]) -> None:
    """Every ``GRPOModule.__init__`` argument by name (``reward_funcs`` and the ``PolicyModule`` ones aside)."""
    k = SimpleNamespace(**knobs)
    check_vllm_knobs(**{name: v for name, v in knobs.items() if name.startswith("vllm_")}, use_vllm=k.use_vllm,
                     generation_kwargs=k.generation_kwargs, cache_implementation=k.cache_implementation)
    if k.padding_free and k.prompt_sharing:
        raise ValueError("padding_free and prompt_sharing are two layouts of the training micro-batch; set one: "
                         "prompt_sharing for long prompts shared by many completions, padding_free for short "
                         "prompts with completions of varied length.")
    validate_grpo_loss_config(
        k.loss_type, k.epsilon, k.epsilon_high, k.beta, k.max_completion_length,
        importance_sampling_level=k.importance_sampling_level, delta=k.delta,
        sapo_temperature_pos=k.sapo_temperature_pos, sapo_temperature_neg=k.sapo_temperature_neg,
        vespo_k_pos=k.vespo_k_pos, vespo_lambda_pos=k.vespo_lambda_pos, vespo_k_neg=k.vespo_k_neg,
        vespo_lambda_neg=k.vespo_lambda_neg, off_policy_mask_threshold=k.off_policy_mask_threshold,
        use_bias_correction_kl=k.use_bias_correction_kl, top_entropy_quantile=k.top_entropy_quantile,
        entropy_coef=k.entropy_coef)
    check_entropy_control(k.entropy_coef, k.use_adaptive_entropy, k.entropy_coef_min, k.entropy_coef_max,
                          k.entropy_coef_delta, k.entropy_target)
    check_generation_knobs(k.generation_kwargs, k.cache_implementation, k.share_prefill)
    if k.use_vllm and (k.generation_backend is not None or k.use_transformers_continuous_batching):
        raise ValueError("use_vllm samples with vLLM; generation_backend / use_transformers_continuous_batching "
                         "pick a transformers backend instead: set only one of them.")
    check_backend_knobs(resolve_backend(k.generation_backend, k.use_transformers_continuous_batching),
                        transformers_continuous_batching_config=k.transformers_continuous_batching_config,
                        repetition_penalty=k.repetition_penalty, generation_kwargs=k.generation_kwargs,
                        cache_implementation=k.cache_implementation)
    if k.num_generations_eval is not None and k.num_generations_eval < 1:
        raise ValueError(f"num_generations_eval must be >= 1 or null (= num_generations), got {k.num_generations_eval}.")
    if k.multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation={k.multi_objective_aggregation!r} is unknown; use one of "
                         f"{list(MULTI_OBJECTIVE_AGGREGATIONS)}.")
    if k.multi_objective_aggregation == "normalize_then_sum" and (
            k.normalize_rewards or k.reward_clip is not None or k.scale_rewards == "none"):
        raise ValueError("multi_objective_aggregation='normalize_then_sum' normalises each reward function per "
                         "group and the weighted sum over the batch itself: unset normalize_rewards and "
                         "reward_clip, and leave scale_rewards at 'group' (it is not used; 'none' would be "
                         "silently ignored).")
    if k.scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards='{k.scale_rewards}' is unknown; use one of {list(SCALE_REWARDS)}.")
    if k.reward_clip is not None and k.reward_clip <= 0:
        raise ValueError(f"reward_clip must be > 0 or null, got {k.reward_clip}.")
