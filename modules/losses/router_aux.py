"""The load-balancing loss of Mixture-of-Experts policies (TRL's ``router_aux_loss_coef``).

A MoE model returns ``aux_loss`` (its router load-balancing loss) when called with ``output_router_logits=True``.
``RouterAuxLoss`` asks for it on every forward of the policy that builds a graph (training forwards; reference,
generation and evaluation forwards run without gradients and are left alone) and keeps what the forwards returned
until the module adds ``coef * mean(aux_loss)`` to its training loss (``PolicyModule.add_router_aux_loss``).

The model computes ``aux_loss`` over the tokens its 2D attention mask marks as real, so it is exact only in the
padded layouts, where that mask is the one the model receives; the shared-prefix and packed layouts pass other
masks (or none), and there the loss is off (refused when the coefficient was set explicitly).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightalign.knobs import KnobGroup, knob

@dataclasses.dataclass(frozen=True)
class RouterAuxKnobs(KnobGroup):
    group = "router_aux"
    router_aux_loss_coef: float | None = knob(
        None, "Mixture-of-Experts policies: weight of the router load-balancing loss added to the training loss "
              "(``RouterAuxLoss``); null takes the model config's value, 0 turns it off; an error on a dense model. "
              "Padded layouts only (off, and said so at fit start, in the others).")

    def check(self) -> None:
        if self.router_aux_loss_coef is not None and not self.router_aux_loss_coef >= 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0 (null: the model config's value), got "
                             f"{self.router_aux_loss_coef}.")


# The layouts where the model receives the 2D padding mask of its batch (see adaptations.LAYOUTS).
AUX_LOSS_LAYOUTS = ("padded", "dpo_classic", "grpo_padded")


def text_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def is_moe(model: torch.nn.Module) -> bool:
    """A model whose forward can return a router load-balancing loss (its config has ``output_router_logits``)."""
    return hasattr(text_config(model), "output_router_logits")


def resolve_router_aux_loss_coef(model: torch.nn.Module, coef: float | None) -> float:
    """The coefficient in force: ``coef`` when set, else the one the model's config declares (0 for a dense model).
    A non-zero ``coef`` on a model without router logits is an error."""
    if coef is not None and coef != 0 and not is_moe(model):
        raise ValueError(
            f"router_aux_loss_coef={coef} but {type(model).__name__} is not a Mixture-of-Experts model (its config has "
            "no output_router_logits), so there is no load-balancing loss to weigh. Drop router_aux_loss_coef."
        )
    if coef is not None:
        return float(coef)
    return float(getattr(text_config(model), "router_aux_loss_coef", 0.0) or 0.0) if is_moe(model) else 0.0


class RouterAuxLoss:
    """Collects ``aux_loss`` from the policy's gradient-building forwards (hooks on ``model``)."""

    def __init__(self, model: torch.nn.Module, coef: float) -> None:
        self.coef = coef
        self.losses: list[torch.Tensor] = []
        self._handles = [
            model.register_forward_pre_hook(self._ask, with_kwargs=True),
            model.register_forward_hook(self._keep),
        ]

    @staticmethod
    def _ask(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not torch.is_grad_enabled():
            return None
        return args, {**kwargs, "output_router_logits": True}

    def _keep(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        aux = getattr(output, "aux_loss", None)
        if torch.is_grad_enabled() and aux is not None:
            self.losses.append(aux)

    def take(self) -> torch.Tensor | None:
        """The mean ``aux_loss`` of the forwards since the last call (None when there were none)."""
        losses, self.losses = self.losses, []
        return torch.stack([loss.float() for loss in losses]).mean() if losses else None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.losses = []


def attach_router_aux_loss(model: torch.nn.Module, coef: float | None, layout: str) -> tuple[RouterAuxLoss | None, str | None]:
    """At fit start: the collector for this run (None when the loss is off) and the fit-start line's note."""
    in_force = resolve_router_aux_loss_coef(model, coef)
    if in_force == 0.0:
        return None, None
    if layout not in AUX_LOSS_LAYOUTS:
        if coef is not None:
            raise ValueError(
                f"router_aux_loss_coef={coef} needs a padded layout, where the model's load-balancing loss counts "
                f"exactly the real tokens; this run's layout is '{layout}'. Use the padded layout (prompt_sharing: "
                "false / padding_free: false / packing: false) or drop router_aux_loss_coef."
            )
        return None, (f"router load-balancing loss off (layout '{layout}' does not give the model its padding mask; "
                      f"the config's router_aux_loss_coef {in_force} applies in the padded layout)")
    return RouterAuxLoss(model, in_force), f"router load-balancing loss x {in_force}"
