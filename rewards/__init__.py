"""Reward functions for GRPO, with TRL's signature ``fn(prompts, completions, **columns) -> list[float | None]``,
and the machinery that runs them (the advantages computed from the rewards: ``lightalign.modules.losses.advantages``)."""

from lightalign.rewards.functions import (
    FormatReward,
    LengthPenalty,
    accuracy_reward,
    completion_text,
    digit_fraction_reward,
    extract_last_number,
    make_format_reward,
    think_format_reward,
)
from lightalign.rewards.model import RewardModel
from lightalign.rewards.resolve import (
    check_reward_weights,
    import_object,
    resolve_reward_funcs,
    reward_func_name,
    reward_func_names,
)
from lightalign.rewards.runner import (
    FallbackReport,
    RewardFunctionError,
    RewardScores,
    check_reward_call_knobs,
    compute_rewards,
)

__all__ = [
    "FallbackReport",
    "FormatReward",
    "LengthPenalty",
    "RewardFunctionError",
    "RewardModel",
    "RewardScores",
    "accuracy_reward",
    "check_reward_call_knobs",
    "check_reward_weights",
    "completion_text",
    "compute_rewards",
    "digit_fraction_reward",
    "extract_last_number",
    "import_object",
    "make_format_reward",
    "resolve_reward_funcs",
    "reward_func_name",
    "reward_func_names",
    "think_format_reward",
]
