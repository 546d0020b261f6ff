"""A batch layout measured in the run's precision when the run computes in bf16, with a tolerance derived from what
bf16 itself does to the same forward.

Under ``precision: bf16-mixed`` Lightning runs every training forward inside ``torch.autocast(device,
dtype=torch.bfloat16, cache_enabled=False)``; under ``bf16-true`` the weights themselves are bf16. A layout that is
exact in float32 can still differ in bf16 when its own code path does something bf16-specific (a mask or position
built in the compute dtype, another kernel for another shape), so for such a run the probe measures the layout
again *in that precision*: the layout's log-probs under the run's bf16 against each sequence's own forward under the
same bf16 (``measure_in_precision``).

An exact layout does not give bitwise-equal log-probs in bf16: its matrix products have other shapes than the
per-sequence forward's, so their float32 accumulations are rounded to bf16 (8 significant bits, unit roundoff
2**-8) at other points, and each forward lands somewhere within bf16's own error of the float32 value. Both
forwards compute the same function on the same tokens, so each carries the error bf16 makes on that function:
``effect`` = max |per-sequence bf16 - per-sequence float32| over the probe's tokens, measured on the same probe and
sequences. By the triangle inequality, an exact layout then differs from the per-sequence bf16 forward by at most
``effect`` (its own rounding) + the float32 verdict's tolerance (``probe.TOLERANCE``) + ``effect`` (the
reference's rounding): ``bf16_tolerance(effect, TOLERANCE) = 2 * effect + TOLERANCE``. A layout beyond it computes something bf16 does not explain.
On the probe's unit-scale weights bf16 moves a log-prob by a few 1e-2 nats (logits of a few units rounded to 8
bits), a layout that leaks across sequences by O(1) nats (numbers: docs/model_support.md 'Exactness in bf16').

Only the log-prob layouts are measured this way; generation backends and the train-mode determinism check keep
their float32 verdicts (greedy tokens and bitwise equality have no bf16 analogue of a tolerance).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

import lightalign.modules.adaptations.probe_layouts as pl

FLOAT32 = "32"  # the probe's own precision: every verdict of a run that does not compute in bf16
BF16_PRECISIONS = ("bf16-mixed", "bf16-true")


def probe_precision(precision: object) -> str:
    """The precision a layout is measured in for a run under Lightning's ``precision`` (``trainer.precision``):
    ``bf16-true`` or ``bf16-mixed`` for a bf16 run (Lightning's ``"bf16"`` is ``bf16-mixed``), else ``FLOAT32``
    (float32 and float64 runs, and fp16, whose CPU autocast is not what a GPU run does)."""
    text = "" if precision is None else str(precision)
    if "bf16" not in text:
        return FLOAT32
    return "bf16-true" if "true" in text else "bf16-mixed"


def bf16_tolerance(effect: float, float32_tolerance: float) -> float:
    """The largest difference (nats per token) an exact layout can show in bf16, given ``effect``: how far bf16
    moves the per-sequence forward's log-probs from float32 on the same probe and tokens, and the float32 verdict's
    own tolerance (module docstring)."""
    return 2.0 * effect + float32_tolerance


@dataclass(frozen=True)
class PrecisionMeasurement:
    """A layout measured in a bf16 precision: its largest difference from the per-sequence forward in the same
    precision (inf if it raised), the tolerance, bf16's effect on the per-sequence forward, and the error if any."""

    difference: float
    tolerance: float
    effect: float
    error: str | None = None

    @property
    def exact(self) -> bool:
        return self.error is None and self.difference <= self.tolerance


@contextlib.contextmanager
def computing_in(precision: str):
    """Forwards as Lightning's precision plugin runs them: ``bf16-mixed`` under CPU autocast to bf16 without the
    weight-cast cache (the probe runs on the CPU whatever the run's device); ``bf16-true`` with weights already
    bf16 (``measure_in_precision`` casts the probe) and nothing else."""
    if precision == "bf16-mixed":
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            yield
    else:
        yield


def measure_in_precision(probe: torch.nn.Module, layout: str, seqs: pl.ProbeSequences, precision: str,
                         float32_tolerance: float) -> PrecisionMeasurement:
    """``layout`` on ``probe`` (float32 weights; cast to bf16 here for ``bf16-true``) in ``precision``: its
    log-probs against each sequence's own forward in the same precision, judged by ``bf16_tolerance`` of bf16's
    measured effect on that forward. (A sequence classifier is measured on ``padded`` only: the float32 verdict
    refuses its other layouts before this runs.)"""
    causal = pl.is_causal_lm(probe)
    alone = pl.alone_logps if causal else (lambda _layout, model, s: pl.alone_scores(model, s))
    float32 = alone(layout, probe, seqs)
    if precision == "bf16-true":
        probe = probe.to(torch.bfloat16)
    with computing_in(precision):
        want = alone(layout, probe, seqs)
        effect = pl.max_difference(want, float32)
        tolerance = bf16_tolerance(effect, float32_tolerance)
        try:
            got = pl.layout_logps(layout, probe, seqs) if causal else pl.padded_scores(probe, seqs)
        except Exception as error:  # noqa: BLE001 - any failure of the layout in this precision is its verdict
            return PrecisionMeasurement(float("inf"), tolerance, effect, f"{type(error).__name__}: {str(error)[:300]}")
    return PrecisionMeasurement(pl.max_difference(got, want), tolerance, effect)
