"""Reward functions the online-RL tests share."""

from __future__ import annotations

import threading

import torch


def varied_reward(prompts, completions, **kwargs):
    """Rewards with variance inside every group (the completion's length in characters, and its digits)."""
    return [len(c) / 10 + sum(ch.isdigit() for ch in c) for c in completions]


class Recorder:
    """A reward function that remembers what it returned, in rollout order."""

    def __init__(self):
        self.rewards = []
        self.__name__ = "recorded"

    def __call__(self, prompts, completions, **kwargs):
        out = varied_reward(prompts, completions)
        self.rewards.append(torch.tensor(out, dtype=torch.float))
        return out


def hangs_forever(prompts, completions, **kwargs):
    """A reward function that never returns (a grader stuck on a dead connection)."""
    threading.Event().wait()
