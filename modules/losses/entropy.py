"""Token entropy in GRPO: per-token entropies, the high-entropy token mask (``top_entropy_quantile``, "Beyond the
80/20 Rule") and the entropy coefficient with its adaptive controller (``use_adaptive_entropy``, Skywork-OR1).

Knob names, defaults and update rule are TRL's (``GRPOConfig``); the code is ours.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

SENTINEL = -1e9  # pads gathered entropies; a real entropy is never negative


def token_entropies(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each token distribution ``[..., V] -> [...]`` in float32 (keeps the graph when grad is on)."""
    x = logits.float()
    return torch.logsumexp(x, -1) - (x.softmax(-1) * x).sum(-1)


@torch.no_grad()
def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float,
                      pool: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens whose entropy is at least the ``1 - quantile`` quantile (linear interpolation, ``torch.quantile``)
    of the real tokens' entropies: ``quantile=1`` keeps every token, ``0`` only the highest-entropy one(s).

    ``pool``: the entropies the quantile is taken over (under data parallelism every rank's real tokens, padded
    with values < 0 which are dropped); default this micro-batch's own real tokens."""
    values = entropies[mask.bool()].float() if pool is None else pool.float()
    values = values[values >= 0]
    if values.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(values, 1.0 - quantile)
    return (entropies >= threshold) & mask.bool()


def check_entropy_control(entropy_coef: float, use_adaptive_entropy: bool, entropy_coef_min: float,
                          entropy_coef_max: float, entropy_coef_delta: float, entropy_target: float,
                          top_entropy_quantile: float = 1.0) -> None:
    """The entropy knobs (the bonus, its adaptive controller and the high-entropy token mask), checked at
    construction."""
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1] (1.0 keeps every token, the paper uses 0.2), got "
                         f"{top_entropy_quantile}.")
    if not entropy_coef >= 0:
        raise ValueError(f"entropy_coef must be >= 0 (0.0 disables the entropy bonus), got {entropy_coef}.")
    if not use_adaptive_entropy:
        return
    if not 0 <= entropy_coef_min <= entropy_coef_max:
        raise ValueError(f"use_adaptive_entropy needs 0 <= entropy_coef_min <= entropy_coef_max, got "
                         f"entropy_coef_min={entropy_coef_min}, entropy_coef_max={entropy_coef_max}.")
    if not entropy_coef_min <= entropy_coef <= entropy_coef_max:
        raise ValueError(f"entropy_coef ({entropy_coef}) is the adaptive controller's starting value and must lie in "
                         f"[entropy_coef_min, entropy_coef_max] = [{entropy_coef_min}, {entropy_coef_max}].")
    if not entropy_coef_delta > 0:
        raise ValueError(f"entropy_coef_delta (the controller's step) must be > 0, got {entropy_coef_delta}.")
    if not entropy_target >= 0:
        raise ValueError(f"entropy_target (nats) must be >= 0, got {entropy_target}.")


class EntropyController:
    """The entropy coefficient the loss applies, fixed (``adaptive=False``) or adapted once per optimizer step.

    Adaptive rule (TRL's): each micro-batch adds its entropy sum and token count to the step's window; at the
    optimizer step the window's global mean entropy ``H`` (summed over ranks) moves the coefficient by ``delta``
    (up if ``H <= target``, else down, kept in ``[low, high]``). The coefficient applies only while the last
    step's ``H <= target``; before the first measurement ``H`` is +inf, so the first step gets no bonus.
    """

    def __init__(self, coef: float, adaptive: bool = False, target: float = 0.2, delta: float = 0.005,
                 low: float = 0.0, high: float = 1.0) -> None:
        self.coef, self.adaptive, self.target, self.delta, self.low, self.high = coef, adaptive, target, delta, low, high
        self.last_entropy = math.inf
        self.window_sum, self.window_count = 0.0, 0.0

    @property
    def enabled(self) -> bool:
        """Whether the loss needs differentiable entropies (constant for the run)."""
        return self.coef != 0.0 or self.adaptive

    def applied_coef(self) -> float:
        if self.adaptive and not self.last_entropy <= self.target:
            return 0.0
        return self.coef

    def observe(self, entropy_sum: torch.Tensor, count: torch.Tensor) -> None:
        """Add one training micro-batch's (selected) token entropies to the optimizer step's window."""
        if self.adaptive:
            self.window_sum += float(entropy_sum)
            self.window_count += float(count)

    def step(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """At the optimizer step: the window's global mean entropy updates the coefficient; the window resets.
        ``reduce_sum`` sums a tensor over ranks (None: one process)."""
        if not self.adaptive:
            return
        totals = torch.tensor([self.window_sum, self.window_count], dtype=torch.float64)
        if reduce_sum is not None:
            totals = reduce_sum(totals)
        entropy = float(totals[0] / totals[1].clamp(min=1.0))
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        self.last_entropy = entropy
        self.window_sum, self.window_count = 0.0, 0.0

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "last_entropy": self.last_entropy, "window_sum": self.window_sum,
                "window_count": self.window_count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
        self.window_sum, self.window_count = float(state["window_sum"]), float(state["window_count"])
