"""Variants chosen by name: policy losses, loss aggregations and advantage estimators.

A variant is a function registered under a name (``register_policy_loss("gmpo")``,
``register_aggregation("sequence_mean")``, ``register_advantage_estimator("rloo")``); a method's knob
(``loss_type``) names it and the lookup (``policy_loss``, ``aggregation``, ``advantage_estimator``) refuses an
unknown name, listing the registered ones. Adding a variant is one registered function, not a branch in every
caller.

* A policy loss maps ``PolicyInputs`` and its method's loss config to the per-token policy term ``[B, T]`` and
  its statistics; it names the aggregation that turns its per-token loss into the scalar loss, and which of the
  per-token weights (``entropy_mask``, ``importance_sampling_ratio``) it applies itself (``grpo_loss`` applies
  the others by multiplication).
* An aggregation maps the masked per-token loss ``[B, T]`` and the float mask to the scalar loss.
* An advantage estimator turns rewards (and values, for GAE) into advantages; each keeps its own arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generic, TypeVar

import torch

T = TypeVar("T")

ENTROPY_MASK = "entropy_mask"
IMPORTANCE_SAMPLING_RATIO = "importance_sampling_ratio"
SELF_APPLIED_WEIGHTS = (ENTROPY_MASK, IMPORTANCE_SAMPLING_RATIO)


class Registry(Generic[T]):
    """Entries by name, in registration order; ``what`` names the choice in errors (``"GRPO loss_type"``)."""

    def __init__(self, what: str):
        self.what = what
        self.entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        if name in self.entries:
            raise ValueError(f"{self.what} {name!r} is already registered; choose another name.")
        self.entries[name] = entry

    def __getitem__(self, name: str) -> T:
        if name not in self.entries:
            valid = ", ".join(repr(n) for n in self.entries)
            raise ValueError(f"Unknown {self.what} {name!r}; valid names are: {valid}.")
        return self.entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)


@dataclasses.dataclass(frozen=True)
class PolicyInputs:
    """What every policy loss may read, all ``[B, T]`` with padding zeroed, except ``adv`` ``[B, 1]``.

    ``logp`` carries the graph; ``old`` is detached; ``log_ratio = logp - old`` per token; ``ratio`` is the
    importance ratio at the configured ``importance_sampling_level`` (per token, or each row's geometric mean
    broadcast); ``mask`` is the boolean completion mask; ``entropy_mask`` (or None) the kept high-entropy tokens;
    ``rho`` (or None) the detached sampler correction ``pi_old / pi_sampler`` (``[B, T]`` holding 1 on padding, or
    ``[B, 1]``)."""

    logp: torch.Tensor
    old: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    entropy_mask: torch.Tensor | None
    rho: torch.Tensor | None


PolicyLossFn = Callable[[PolicyInputs, Any], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: its function, the aggregation it is normalised by, the per-token weights it
    applies itself (the rest ``grpo_loss`` multiplies in), whether it reads ``delta`` (two-sided clipping), and
    its own knob check (``check(config)``, run with the config's, once, at construction)."""

    name: str
    fn: PolicyLossFn
    aggregation: str
    applies: frozenset[str] = frozenset()
    reads_delta: bool = False
    check: Callable[[Any], None] | None = None


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """A registered token normalisation ``fn(per_token_loss, mask, *, max_completion_length, num_items_in_batch)``;
    ``step_tokens``: it divides by ``num_items_in_batch``, the completion tokens of the whole optimizer step, so
    the caller counts them and scales the loss by the accumulation (see ``grpo_loss``)."""

    name: str
    fn: Callable[..., torch.Tensor]
    step_tokens: bool = False


POLICY_LOSSES: Registry[PolicyLoss] = Registry("GRPO loss_type")
AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")
ADVANTAGE_ESTIMATORS: Registry[Callable[..., Any]] = Registry("advantage estimator")


def register_policy_loss(name: str, *, aggregation: str, applies: tuple[str, ...] = (), reads_delta: bool = False,
                         check: Callable[[Any], None] | None = None) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register ``fn(inputs: PolicyInputs, config) -> (policy [B, T], stats)`` as the policy loss ``name``,
    normalised by the registered ``aggregation``; ``applies``: the weights of ``SELF_APPLIED_WEIGHTS`` it reads
    from ``inputs`` itself. The same function may be registered under several names (with different
    aggregations)."""
    unknown = set(applies) - set(SELF_APPLIED_WEIGHTS)
    if unknown:
        raise ValueError(f"applies names {sorted(unknown)}; a policy loss may apply {list(SELF_APPLIED_WEIGHTS)}.")
    AGGREGATIONS[aggregation]  # an aggregation registered before the loss that uses it  # noqa: B018

    def decorate(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES.add(name, PolicyLoss(name, fn, aggregation, frozenset(applies), reads_delta, check))
        return fn

    return decorate


def register_aggregation(name: str, *, step_tokens: bool = False) -> Callable[[Callable], Callable]:
    """Register ``fn(per_token_loss, mask, *, max_completion_length, num_items_in_batch) -> loss`` as ``name``."""

    def decorate(fn: Callable) -> Callable:
        AGGREGATIONS.add(name, Aggregation(name, fn, step_tokens))
        return fn

    return decorate


def register_advantage_estimator(name: str) -> Callable[[Callable], Callable]:
    """Register an advantage estimator under ``name`` (its arguments are its own: rewards, groups, values)."""

    def decorate(fn: Callable) -> Callable:
        ADVANTAGE_ESTIMATORS.add(name, fn)
        return fn

    return decorate


def policy_loss(name: str) -> PolicyLoss:
    """The registered policy loss ``name``; ``ValueError`` listing the registered names otherwise."""
    return POLICY_LOSSES[name]


def aggregation(name: str) -> Aggregation:
    """The registered aggregation ``name``; ``ValueError`` listing the registered names otherwise."""
    return AGGREGATIONS[name]


def advantage_estimator(name: str) -> Callable[..., Any]:
    """The registered advantage estimator ``name``; ``ValueError`` listing the registered names otherwise."""
    return ADVANTAGE_ESTIMATORS[name]


def normalises_by_step_tokens(loss_type: str) -> bool:
    """Whether the policy loss ``loss_type`` divides by the optimizer step's completion tokens
    (``num_items_in_batch``), so its caller counts them and scales the loss by the accumulation."""
    return AGGREGATIONS[POLICY_LOSSES[loss_type].aggregation].step_tokens
