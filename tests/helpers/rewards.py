"""Reward functions the online-RL tests share."""

from __future__ import annotations

import threading

import torch


def varied_reward(prompts, completions, **kwargs):
    """Rewards with variance inside every group (the completion's length in characters, and its digits)."""
    return [len(c) / 10 + sum(ch.isdigit() for ch in c) for c in completions]


def ranked_reward(prompts, completions, **kwargs):
    """Rewards that differ inside every group by construction: the completion's position in the call plus a fraction
    below 1 from its length (``n / (n + 1)`` for length ``n``), so they strictly increase along the rollout whatever
    was sampled, and still depend on what was."""
    return [i + len(c) / (len(c) + 1) for i, c in enumerate(completions)]


class Recorder:
    """A reward function that remembers what it returned, in rollout order: ``ranked_reward``'s rewards, which differ
    inside every group."""

    def __init__(self):
        self.rewards = []
        self.__name__ = "recorded"

    def __call__(self, prompts, completions, **kwargs):
        out = ranked_reward(prompts, completions)
        self.rewards.append(torch.tensor(out, dtype=torch.float))
        return out


def hangs_forever(prompts, completions, **kwargs):
    """A reward function that never returns (a grader stuck on a dead connection)."""
    threading.Event().wait()
