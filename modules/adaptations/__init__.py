"""Model adaptations: everything lightalign changes in how a Hugging Face model computes, in one place.

* ``sdpa_varlen`` (``register_varlen_sdpa``): per-sequence / per-segment SDPA for packed and shared-prefix rows,
  sliding windows kept;
* ``recompute_mlp_activation``: gated SiLU MLPs that keep one activation tensor less;
* ``check_layout``: refuses a layout (or generation backend) a model does not run exactly, as measured by the
  probe (``measure``) on a shrunk copy of the model (``probe_model``, ``layout_logps``; verdicts cached on disk),
  called at fit start by every module; ``check_vision_layout`` does the same with images in the rows (a
  vision-language model's probe fed its processor's rows, ``vision_probe``).

``adapt_model`` applies the adaptations a ``PolicyModule`` asks for and returns an ``AdaptationReport``; its
``describe()`` is the fit-start line, and its ``as_dict()`` goes into the saved run config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightalign.modules.adaptations.attention import VARLEN_SDPA, use_varlen_sdpa
from lightalign.modules.adaptations.mlp_memory import MLPReport, mlp_report, recompute_mlp_activation
from lightalign.modules.adaptations.support import (
    LAYOUTS,
    PACKED_LAYOUTS,
    LayoutRefused,
    ModelTraits,
    check_layout,
    model_traits,
)
from lightalign.modules.adaptations.vision_probe import check_vision_layout

__all__ = ["LAYOUTS", "AdaptationReport", "LayoutRefused", "ModelTraits", "adapt_model", "check_layout", "check_run",
           "check_vision_layout", "model_traits"]


@dataclass
class AdaptationReport:
    """What was adapted in a model: attention, MLPs, and (set at fit start) the batch layout in use."""

    family: str = "?"
    attention: str = "?"
    mlps: MLPReport = field(default_factory=MLPReport)
    mlp_recompute: str = "off"  # off | on | liger
    layout: str | None = None
    layout_decided: str = ""  # how the layout's exactness was decided (measured on a probe, or a cached verdict)
    sliding_window: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def mlps_switched(self) -> int:
        return self.mlps.switched

    @property
    def mlps_total(self) -> int:
        return self.mlps.total

    def describe(self) -> str:
        attention = self.attention
        if attention == VARLEN_SDPA:
            attention += (" (sdpa, one call per sequence)" if self.layout in PACKED_LAYOUTS
                          else " (sdpa with the shared-prefix mask)" if self.layout in ("dpo_shared", "grpo_shared")
                          else " (plain sdpa for this layout)")
        if self.sliding_window is not None:
            attention += f", sliding window {self.sliding_window} kept"
        mlp = {"off": "off", "liger": "Liger SwiGLU"}.get(self.mlp_recompute, self.mlps.describe())
        layout = f"{self.layout or '-'}{f' ({self.layout_decided})' if self.layout_decided else ''}"
        parts = [f"model {self.family}", f"attention {attention}", f"layout {layout}",
                 f"recompute_mlp_activation {mlp}"] + self.notes
        return "lightalign adaptations: " + ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"family": self.family, "attention": self.attention, "layout": self.layout, "layout_decided": self.layout_decided,
                "recompute_mlp_activation": self.mlp_recompute, "mlps_switched": self.mlps.switched,
                "mlps_total": self.mlps.total, "sliding_window": self.sliding_window, "mlps_skipped": dict(self.mlps.skipped), "notes": list(self.notes)}


def adapt_model(model: torch.nn.Module, recompute_mlp: bool = True, liger: bool = False,
                varlen_attention: bool = True) -> AdaptationReport:
    """Apply lightalign's adaptations to ``model`` in place (before LoRA wrapping and ``torch.compile``):
    Liger kernels or ``recompute_mlp_activation``, then ``sdpa -> sdpa_varlen``. Each is exact where it is applied
    (the conformance tests hold every model family to it); the report says what was done."""
    report = AdaptationReport()
    if liger:
        from lightalign.modules.training.acceleration import apply_liger_kernel

        apply_liger_kernel(model)
        report.mlp_recompute = "liger"
    elif recompute_mlp:  # (Liger's SwiGLU recomputes by itself)
        recompute_mlp_activation(model)
        report.mlp_recompute = "on"
    if varlen_attention:
        use_varlen_sdpa(model)
    report.mlps = mlp_report(model)
    traits = model_traits(model)
    report.family, report.attention, report.sliding_window = traits.family, traits.attn, traits.sliding_window
    return report


def check_run(model: torch.nn.Module, ref_model: torch.nn.Module | None, layout: str, longest: int | None,
              report: AdaptationReport, device: torch.device, logger: Any = None, notes: list[str] = (),
              precision: object = None) -> None:
    """Fit start, before any batch: packed rows on a GPU take flash-attention varlen when installed; the layout
    is refused (``LayoutRefused``) if the policy or a separate reference cannot compute it exactly; the fit-start
    line says what was adapted, and the same facts go to the logger's hyperparameters (``hparams.yaml``).
    ``precision``: the trainer's; a bf16 run's layout is measured in bf16 as well."""
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    from lightalign.modules.adaptations.support import batch_dependence_note, packed_gpu_attention

    verdicts = [check_layout(m, layout, max_tokens=longest, precision=precision) for m in (model, ref_model)
                if m is not None]
    if layout in PACKED_LAYOUTS and (choice := packed_gpu_attention(model, device)) is not None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.set_attn_implementation(choice)
        report.attention = choice
    report.layout, report.notes = layout, list(notes)
    report.layout_decided = describe_decision(verdicts[0])
    if (note := batch_dependence_note(model, verdicts[0])) is not None:  # the reference shares the policy's class
        rank_zero_warn(note)
        report.notes.append(f"batch-dependent model (up to {verdicts[0].batch_dependence:.1e} nats, warned)")
    rank_zero_info(report.describe())
    if logger is not None:
        logger.log_hyperparams({"lightalign_adaptations": report.as_dict()})


def describe_decision(verdict) -> str:
    """How a layout's exactness was decided, for the fit-start line."""
    if verdict.not_measured:
        return f"not measured: {verdict.not_measured}"
    how = "cached verdict" if verdict.cached else f"measured on a probe in {verdict.seconds:.2f} s"
    if getattr(verdict, "precision", "32") != "32":
        how = f"in {verdict.precision} within {verdict.tolerance:.1e} nats, {how}"
    return f"exact, {how}"
