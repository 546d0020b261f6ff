"""The scoring stage: a rollout's completions through the reward functions, with the statistics every online-RL
method logs (reward mean/std per function and in total, completion lengths, the truncated share, and with
``reward_fallback_value`` the substitutions per function) and the sample table of the last rollout
(``CompletionSamples``). Reward functions get TRL's ``trainer_state``, ``log_extra`` and ``log_metric``
(``RewardTrainerState``, ``RewardLogs``): their extra columns join the sample table, their metrics the statistics."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightalign.modules.training.stat_metrics import metric_key
from lightalign.modules.losses.advantages import nanstd
from lightalign.rewards import FallbackReport, compute_rewards
from lightalign.rewards.calling import short_repr
from lightalign.rewards.trl_kwargs import RewardLogs, RewardTrainerState

__all__ = ["fallback_stat", "metric_key", "score_rollout"]


def fallback_stat(reward_name: str) -> str:
    """The statistic counting a reward function's fallback substitutions per rollout."""
    return f"reward/{reward_name}/fallbacks"


def score_rollout(module: Any, rollout: dict[str, Any], stats: torch.nn.ModuleDict
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each reward function's rewards ``[N, F]`` and their weighted sum ``[N]`` on the module's device (NaN where
    no function scored a completion, as in TRL), logged in ``stats``; sets ``module.last_samples``; while
    validating, the module's eval metrics see each scored completion's total. With ``reward_fallback_value``, each
    function's substitutions are counted in ``stats`` and its first one is warned about once per run."""
    hp = module.hparams
    logs = RewardLogs()  # TRL's trainer_state, log_extra, log_metric reach every reward function
    columns = {**rollout["columns"], **logs.kwargs(RewardTrainerState.of(module))}
    per_func, total, fallbacks = compute_rewards(
        module.reward_funcs, rollout["prompts"], rollout["completions"], columns, module.reward_weights,
        reward_timeout=hp.reward_timeout, reward_fallback_value=hp.reward_fallback_value)
    extra = logs.columns(len(rollout["prompts"]))
    for name, values in logs.metrics.items():
        stats.add(name).update(torch.tensor(sum(values) / len(values)))
    if hp.reward_fallback_value is not None:
        for name in module.reward_names:
            report = fallbacks.get(name)
            stats[metric_key(fallback_stat(name))].update(float(report.count if report else 0))
            if report and name not in module.reward_fallbacks_warned:
                module.reward_fallbacks_warned.add(name)
                warnings.warn(_fallback_warning(name, report, rollout, hp.reward_fallback_value), RuntimeWarning,
                              stacklevel=2)
    total = total.to(module.device).float()
    if (~torch.isnan(total)).any():
        stats[metric_key("reward/mean")].update(torch.nanmean(total))
        stats[metric_key("reward/std")].update(nanstd(total))
    for j, name in enumerate(module.reward_names):
        column = per_func[:, j]
        if (~torch.isnan(column)).any():
            stats[metric_key(f"reward/{name}")].update(torch.nanmean(column.float()))
    lengths = rollout["completion_mask"].sum(-1).float()
    stats[metric_key("completions/mean_length")].update(lengths.mean())
    stats[metric_key("completions/clipped_ratio")].update(rollout["truncated"].float().mean())
    if "tool_calls" in rollout:  # TRL's names: calls per completion, failed share of the calls
        calls, failures = rollout["tool_calls"], rollout["tool_failures"]
        stats[metric_key("tools/call_frequency")].update(torch.tensor(calls / max(1, len(rollout["texts"]))))
        if calls:
            stats[metric_key("tools/failure_frequency")].update(torch.tensor(failures / calls))
    module.last_samples = [
        {"step": module.global_step, "prompt": _last_turn_text(p), "completion": t,
         "reward": float(r), **{n: float(per_func[i, j]) for j, n in enumerate(module.reward_names)},
         **{column: values[i] for column, values in extra.items()}}
        for i, (p, t, r) in enumerate(zip(rollout["prompts"], rollout["texts"], total.tolist()))
    ]
    if not module.training and (module.eval_metric_objects or module.eval_metric_fns):
        scored = total[~torch.isnan(total)]  # eval_metrics see each scored completion's total reward
        module.update_eval_metrics(scored, torch.ones_like(scored, dtype=torch.long))
    return per_func, total


def _last_turn_text(prompt: Any) -> str:
    """What the sample table shows of a prompt: the string, or its last turn's text (content parts joined, an image
    part as ``<image>``)."""
    if isinstance(prompt, str):
        return prompt
    content = prompt[-1]["content"]
    if isinstance(content, list):
        return "".join("<image>" if part.get("type") == "image" else part.get("text") or "" for part in content)
    return content


def _fallback_warning(name: str, report: FallbackReport, rollout: dict[str, Any], value: float) -> str:
    i, n = report.first_row, len(rollout["prompts"])
    return (f"Reward function '{name}' {report.cause}: {report.count} of the {n} completions of this rollout got "
            f"reward_fallback_value {value:g} instead (the first: index {i}, prompt {short_repr(rollout['prompts'][i])}"
            f"). Each substitution is counted in the logged {fallback_stat(name)}; this warning is not repeated for "
            f"'{name}'.")
