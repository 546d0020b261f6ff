"""BEMA as the reference model (TRL's ``BEMACallback`` with ``update_ref_model=True``; Block and Zhang, "EMA Without
the Lag: Bias-Corrected Iterate Averaging Schemes", arXiv 2508.00180).

Over the policy's trainable parameters ``theta_t`` it keeps ``theta_0`` (the weights at step ``update_after``), an
exponential moving average ``ema`` and the bias-corrected average ``bema = ema + alpha_t * (theta_t - theta_0)``,
with ``beta_t = max((lag + multiplier * t) ** -ema_power, min_ema_multiplier)`` the EMA's weight of ``theta_t`` and
``alpha_t = (lag + multiplier * t) ** -bias_power`` the correction's scale, ``t`` the optimizer step. Every
``update_freq`` steps after ``update_after`` the EMA takes ``theta_t`` and ``bema`` is recomputed; every
``ref_model_update_freq`` steps from ``ref_model_update_after`` on the reference takes ``bema``'s weights. The
callback that times it and keeps the state in checkpoints is ``BEMAReference``; ``BEMAWeights`` is the state and
its arithmetic, in TRL's operation order.

Like TR-DPO's sync it rewrites a reference held as its own model: the same reference modes are refused
(``refuse_bema_reference``, with the method's ``reference_sync_blocker``), and so is ``sync_ref_model`` beside it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightalign.knobs import KnobGroup, knob


@dataclasses.dataclass(frozen=True)
class BEMAKnobs(KnobGroup):
    """BEMA of the policy's weights as the reference model (``BEMAReference``), with TRL ``BEMACallback``'s names."""

    group = "bema"
    update_ref_model: bool = knob(
        False, "BEMA reference (TRL's BEMACallback(update_ref_model=True)): the reference becomes an exponential "
               "moving average of the policy's weights with BEMA's bias correction, renewed every "
               "``ref_model_update_freq`` optimizer steps; kept in checkpoints. Not with sync_ref_model, precomputed reference log-probs, LoRA, a "
               "quantized reference or FSDP/ZeRO-3.")
    update_freq: int = knob(400, "BEMA: optimizer steps between updates of the average (the paper's phi; default 400).")
    ema_power: float = knob(0.5, "BEMA: the EMA weight's power kappa, beta_t = (lag + multiplier * t) ** -kappa "
                                 "(default 0.5; 0 makes the EMA the current weights).")
    bias_power: float = knob(0.2, "BEMA: the bias correction's power eta, alpha_t = (lag + multiplier * t) ** -eta "
                                  "(default 0.2; 0 keeps alpha_t at 1, a large value approaches plain EMA).")
    lag: int = knob(10, "BEMA: the schedule's offset rho, a virtual starting age of the average (default 10).")
    update_after: int = knob(0, "BEMA: burn-in tau, the optimizer step whose weights are theta_0 and the EMA's start; "
                                "no update before it (default 0: the initial policy).")
    multiplier: float = knob(1.0, "BEMA: gamma, the step's scale in lag + gamma * t (default 1.0).")
    min_ema_multiplier: float = knob(0.0, "BEMA: the EMA weight's floor, beta_t >= this (default 0.0).")
    device: str = knob("cpu", "BEMA: where theta_0, the EMA and the average are held, 'cpu' (default) or the "
                              "training accelerator's type ('cuda': each rank's own device).")
    ref_model_update_freq: int = knob(400, "BEMA: optimizer steps between copies of the average into the reference "
                                           "(default 400).")
    ref_model_update_after: int = knob(0, "BEMA: the first optimizer step that may copy the average into the "
                                          "reference (default 0).")

    def check(self) -> None:
        for name in ("update_freq", "ref_model_update_freq"):
            value = getattr(self, name)
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (optimizer steps; default 400), got {value}.")
        for name in ("update_after", "ref_model_update_after", "lag"):
            value = getattr(self, name)
            if int(value) != value or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value}.")
        if not self.multiplier > 0:
            raise ValueError(f"multiplier must be > 0 (BEMA's gamma in lag + gamma * t; default 1.0), got "
                             f"{self.multiplier}.")
        for name in ("ema_power", "bias_power"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        if not 0.0 <= self.min_ema_multiplier <= 1.0:
            raise ValueError(f"min_ema_multiplier must lie in [0, 1] (a floor on the EMA's weight), got "
                             f"{self.min_ema_multiplier}.")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must name a torch device ('cpu' or e.g. 'cuda'), got {self.device!r}: {e}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: this machine has no CUDA device; keep BEMA's weights on "
                             "'cpu' (the default).")
        if not self.update_ref_model:  # the schedule's knobs act only on a BEMA reference: set alone, a no-op
            changed = [f.name for f in self.knob_fields()
                       if f.name != "update_ref_model" and getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(f"{', '.join(changed)} set{'s' if len(changed) == 1 else ''} BEMA's schedule, "
                                 "which acts only on a BEMA reference: add update_ref_model: true, or leave "
                                 f"{'it' if len(changed) == 1 else 'them'} out.")


def ema_beta(knobs: BEMAKnobs, step: int) -> float:
    """The EMA's weight of the current weights at optimizer step ``step``: ``max((lag + gamma t)^-kappa, floor)``."""
    return max((knobs.lag + knobs.multiplier * step) ** (-knobs.ema_power), knobs.min_ema_multiplier)


def bema_alpha(knobs: BEMAKnobs, step: int) -> float:
    """The bias correction's scale at optimizer step ``step``: ``(lag + gamma t)^-eta``."""
    return (knobs.lag + knobs.multiplier * step) ** (-knobs.bias_power)


def averaged_parameters(policy: torch.nn.Module, reference: torch.nn.Module | None) -> list[str]:
    """The policy parameters BEMA averages: the trainable ones (TRL's), less those the reference shares
    (``num_shared_layers``: frozen, the same tensor in both)."""
    shared = {id(p) for p in reference.parameters()} if reference is not None else set()
    return [n for n, p in policy.named_parameters() if p.requires_grad and id(p) not in shared]


class BEMAWeights:
    """``theta_0``, the EMA and the bias-corrected average of the named policy parameters, on ``device``."""

    def __init__(self, knobs: BEMAKnobs, policy: torch.nn.Module, names: list[str], device: torch.device) -> None:
        self.knobs, self.names, self.device = knobs, names, device
        params = dict(policy.named_parameters())
        self.theta0 = {n: params[n].detach().to(device, copy=True) for n in names}
        self.ema = {n: t.clone() for n, t in self.theta0.items()}
        self.average = {n: t.clone() for n, t in self.theta0.items()}  # TRL's running model: the initial policy

    @torch.no_grad()
    def step(self, policy: torch.nn.Module, step: int) -> bool:
        """TRL's ``on_step_end`` for BEMA's part after optimizer step ``step``: nothing before ``update_after``,
        the snapshot of ``theta_0`` and the EMA at it, an update every ``update_freq`` steps after it. Returns
        whether the average changed."""
        knobs = self.knobs
        if step < knobs.update_after:
            return False
        params = dict(policy.named_parameters())
        if step == knobs.update_after:
            for n in self.names:
                self.theta0[n].copy_(params[n])
                self.ema[n].copy_(params[n])
            return False
        if (step - knobs.update_after) % knobs.update_freq:
            return False
        beta, alpha = ema_beta(knobs, step), bema_alpha(knobs, step)
        for n in self.names:
            theta = params[n].detach().to(self.device)
            ema = self.ema[n]
            ema.mul_(1 - beta).add_(theta, alpha=beta)
            self.average[n].copy_(ema + alpha * (theta - self.theta0[n]))
        return True

    def reference_due(self, step: int) -> bool:
        """Whether the reference takes the average after optimizer step ``step`` (TRL's schedule, independent of
        ``update_after``)."""
        after = self.knobs.ref_model_update_after
        return step >= after and (step - after) % self.knobs.ref_model_update_freq == 0

    @torch.no_grad()
    def copy_into(self, reference: torch.nn.Module) -> None:
        """The reference's averaged parameters take the average's values (in the reference's dtype and device)."""
        params = dict(reference.named_parameters())
        for n in self.names:
            params[n].copy_(self.average[n])

    def state_dict(self) -> dict[str, Any]:
        return {"theta0": self.theta0, "ema": self.ema, "average": self.average}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if sorted(state["theta0"]) != sorted(self.names):
            raise ValueError("This checkpoint's BEMA state (update_ref_model) averages other parameters than this "
                             "run's policy has; resume with the model and settings that wrote it.")
        for key in ("theta0", "ema", "average"):
            mine = getattr(self, key)
            for n in self.names:
                mine[n].copy_(state[key][n])


def refuse_bema_reference(sync_ref_model: bool, why: str | None) -> None:
    """``update_ref_model`` refused at construction: beside ``sync_ref_model`` (both rewrite the reference), or for
    the reason the method gives why it has no reference model of its own (``reference_sync_blocker``)."""
    if sync_ref_model:
        raise ValueError("update_ref_model=True (a BEMA reference) and sync_ref_model=True (TR-DPO) both rewrite the "
                         "reference model: choose one of them.")
    if why:
        raise ValueError(f"update_ref_model=True (a BEMA reference) cannot work here: {why}. Drop update_ref_model "
                         "(and its BEMA knobs).")
