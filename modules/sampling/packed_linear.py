"""Decode-time linears on oneDNN-prepacked weights (CPU, float32): the ``compact`` backend's matmuls.

A decode step multiplies a handful of rows (the live completions) by every weight matrix of the model. For such
short, wide products PyTorch's default CPU path (MKL ``sgemm`` on the ``[out, in]`` weight) is far from the memory
bound; oneDNN on a weight reordered once into its blocked layout is not (measured on the project's CPU, see
docs/performance.md 'Prepacked linears').

``packed_linears(model)`` is a context manager: inside it, every module whose type is exactly ``torch.nn.Linear``
(not a subclass: quantized, LoRA-merged or parametrized linears keep their own forward), on the CPU, with a plain
float32 weight and no forward pre-hooks, computes ``x @ W.T + b`` with ``torch.ops.mkldnn._linear_pointwise`` on a
prepacked copy of ``W`` made on entry. On exit every module gets its own forward back and the copies are freed: while a
rollout samples, the linear weights are held twice (one more copy of every eligible weight). The weights must not change
inside the context (generation runs under ``no_grad`` between optimizer steps); a call that needs what the copy cannot
give (a gradient, autocast, another dtype or device) runs the module's own ``F.linear``.

The result is the same product as ``F.linear``'s up to float32 rounding (another summation order; tests bound the
difference), so a sampled completion's distribution is unchanged. It is entered only where it was measured: CPU,
float32, oneDNN built in, no autocast, and (``compact_groups``) a model whose eligible weights hold at least the
small model's 116 MiB: on small matrices the reorder at each rollout and oneDNN's per-call cost lose
(``compact_prepack_min_mib`` in ``tuned``'s table; docs/performance.md 'Prepacked linears').
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from lightalign.modules.training.device_tuning import tuned

# the batch size oneDNN's weight layout is chosen for: ``tuned``'s ``packed_linear_rows_hint`` for the CPU, the
# only device type whose weights are packed (hints 8 and 32 measured the same: docs/performance.md)
ROWS_HINT = tuned("packed_linear_rows_hint", "cpu")


def available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _eligible(module: torch.nn.Module) -> bool:
    if type(module) is not torch.nn.Linear:
        return False
    weight = module.weight
    return (not module._forward_pre_hooks
            and type(weight.data) is torch.Tensor and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.layout == torch.strided and (module.bias is None or module.bias.dtype == torch.float32)
            and "forward" not in vars(module))


def eligible_mib(model: torch.nn.Module) -> float:
    """MiB of the weights ``packed_linears`` would prepack in ``model`` (each shared weight once)."""
    weights = {id(m.weight): m.weight for m in model.modules() if _eligible(m)}
    return sum(w.numel() * w.element_size() for w in weights.values()) / 2**20


class _PackedForward:
    """The forward a patched linear runs: the prepacked product, or the module's own when the call needs it."""

    def __init__(self, module: torch.nn.Linear, rows_hint: int) -> None:
        self.module = module
        self.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), rows_hint)
        self.bias = None if module.bias is None else module.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled()
                or torch.is_autocast_enabled("cpu") or x.dim() < 2):
            return torch.nn.functional.linear(x, self.module.weight, self.module.bias)
        return prepacked_linear(x.contiguous(), self.packed, self.bias)


def prepacked_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` on oneDNN's prepacked ``W``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows_hint: int | None = None) -> Iterator[int]:
    """Run ``model``'s eligible linears on prepacked oneDNN weights inside the block; yields how many were patched
    (0 when oneDNN is missing, autocast is on, or the model is compiled). ``rows_hint``: default the table's
    ``packed_linear_rows_hint`` for the CPU (eligible weights are CPU weights)."""
    rows_hint = tuned("packed_linear_rows_hint", "cpu") if rows_hint is None else rows_hint
    compiled = getattr(model, "_compiled_call_impl", None) is not None or hasattr(model, "_orig_mod")
    if not available() or torch.is_autocast_enabled("cpu") or compiled:
        yield 0
        return
    patched = []
    try:
        for module in model.modules():
            if _eligible(module):
                module.forward = _PackedForward(module, rows_hint)
                patched.append(module)
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
