"""REINFORCE Leave-One-Out (RLOO, Ahmadian et al. 2024): the loss, a pure function of tensors (the advantages:
``rloo_advantages`` and ``kl_penalized_rewards``, with the other estimators).

Rewards are laid out as GRPO lays them out: rows ``i*G .. i*G+G-1`` are the ``G = num_generations`` completions of
prompt ``i``; a NaN reward marks a completion no reward function could score. The formulas are TRL 1.16's
``RLOOTrainer`` (checked against its source):

* the KL penalty goes into the reward, per sequence: ``r - beta * sum_t (logp_old_t - logp_ref_t)`` (the first-order
  log-ratio, which may be negative per token, summed over the completion's tokens);
* the baseline of a completion is the mean reward of the *other* scorable completions of its prompt, and the
  advantage is ``r - baseline``; ``normalize_advantages`` then standardises the advantages over the batch
  (``(a - mean) / (std + 1e-4)``); unscorable completions (and a group with one scorable completion) get 0;
* the loss is PPO's clipped surrogate on the *sequence* log-probability ratio ``exp(sum_t logp_t - sum_t
  logp_old_t)``, averaged over the sequences.
"""

from __future__ import annotations

import torch

__all__ = ["rloo_loss"]


def rloo_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor | None, advantages: torch.Tensor,
              completion_mask: torch.Tensor, epsilon: float = 0.2, epsilon_high: float | None = None, *,
              importance_sampling_ratio: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate on sequence ratios, averaged over the ``N`` sequences:
    ``-mean_i(rho_i min(r_i A_i, clamp(r_i, 1 - epsilon, 1 + epsilon_high) A_i))``.

    ``per_token_logps``/``old_per_token_logps``/``completion_mask``: ``[N, T]``; ``old`` None means on-policy
    (the ratio is 1 in value, with the policy's gradient). ``advantages``: ``[N]``.
    ``importance_sampling_ratio``: ``rho``, a detached per-sequence weight ``[N, 1]`` or ``[N]`` (default 1), the
    sequence-level ratio ``pi_old / pi_sampler`` of ``importance_sampling_ratio`` for rollouts drawn by
    another sampler. RLOO's loss is one term per sequence, so only the ``sequence_truncate``/``sequence_mask``
    modes apply; a token-level ratio has no place to go (refuse those modes for RLOO). TRL 1.16's RLOOTrainer has
    no such correction; the weight multiplies each sequence's surrogate as GRPO's multiplies its policy term.
    Returns the loss and the clip statistics (``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
    ``clip_ratio/region_mean``).
    """
    n = per_token_logps.shape[0]
    if importance_sampling_ratio is not None and tuple(importance_sampling_ratio.shape) not in ((n,), (n, 1)):
        raise ValueError(f"importance_sampling_ratio must be one weight per sequence, [N, 1] or [N] with N = {n} "
                         f"(a sequence-level mode), got {tuple(importance_sampling_ratio.shape)}.")
    high = epsilon if epsilon_high is None else epsilon_high
    mask = completion_mask.to(per_token_logps.dtype)
    logps = (per_token_logps * mask).sum(-1)
    old = logps.detach() if old_per_token_logps is None else (old_per_token_logps * mask).sum(-1)
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    surrogate = torch.min(ratio * advantages, clipped * advantages)
    if importance_sampling_ratio is not None:
        surrogate = surrogate * importance_sampling_ratio.detach().reshape(n).to(surrogate.dtype)
    loss = -surrogate.mean()
    with torch.no_grad():
        low_clipped = ((ratio < 1 - epsilon) & (advantages < 0)).float()
        high_clipped = ((ratio > 1 + high) & (advantages > 0)).float()
        stats = {"clip_ratio/low_mean": low_clipped.mean(), "clip_ratio/high_mean": high_clipped.mean(),
                 "clip_ratio/region_mean": (low_clipped + high_clipped).clamp(max=1).mean()}
    return loss, stats
