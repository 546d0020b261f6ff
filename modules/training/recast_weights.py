"""Mixed precision without a second copy of the weights held for the backward pass: ``recast_saved_weights``.

Under ``bf16-mixed`` autocast casts each float32 weight to bf16 for its matrix product, and autograd keeps that cast
until the backward pass, where the gradient of the product's input needs it: from the end of a forward until its
backward, a step holds a bf16 copy of every weight it used (half the float32 parameter bytes) next to the float32
weights themselves. ``recast_saved_weights`` is a pair of saved-tensor hooks (``torch.autograd.graph
.saved_tensors_hooks``) that keep, instead of such a cast, a reference to its float32 parameter (alive anyway) and
cast it again when the backward pass unpacks it, with the view (sizes, strides, offset) the forward saved.

The backward computes the same numbers: the same formulas run on operands with the same bits (a float32 to bf16 cast
is deterministic, round to nearest even) and the same layout. A saved tensor is recast only when it is a lower
precision cast (``ToCopyBackward0``) of a float32 leaf that requires grad (its ``AccumulateGrad``), or a view of such
a cast; anything else (activations, casts of frozen weights such as LoRA's base weights, which have no grad_fn to
tell them apart) is kept as autograd keeps it. A weight changed in place between the forward and the backward is an
error, as it is for autograd's own saved tensors. The cost is one more cast of each such weight per backward (a read
of its float32 and a write of its bf16, memory-bound). Only first-order gradients: the recast tensor is not connected
to the graph (no ``create_graph`` through it).
"""

from __future__ import annotations

import torch

LOWER_PRECISION = (torch.bfloat16, torch.float16)


class _Recast:
    """What the forward keeps instead of a cast weight: the float32 parameter and the saved view's geometry."""

    __slots__ = ("param", "dtype", "size", "stride", "offset", "version")

    def __init__(self, param: torch.Tensor, saved: torch.Tensor) -> None:
        self.param, self.dtype, self.version = param, saved.dtype, param._version
        self.size, self.stride, self.offset = saved.size(), saved.stride(), saved.storage_offset()

    def tensor(self) -> torch.Tensor:
        if self.param._version != self.version:
            raise RuntimeError(
                f"a weight of shape {tuple(self.param.shape)} needed for the backward pass was modified in place "
                f"between the forward and the backward (version {self.param._version}, saved at {self.version})")
        return self.param.detach().to(self.dtype).as_strided(self.size, self.stride, self.offset)


def cast_parameter(saved: torch.Tensor) -> torch.Tensor | None:
    """The float32 leaf that ``saved`` is a contiguous lower-precision cast of (or a view of one); else None."""
    if saved.dtype not in LOWER_PRECISION:
        return None
    cast = saved._base if saved._base is not None else saved
    node = cast.grad_fn
    if node is None or node.name() != "ToCopyBackward0":
        return None
    param = getattr(node.next_functions[0][0], "variable", None)  # an AccumulateGrad node holds its leaf
    if (param is None or param.dtype != torch.float32 or not param.is_contiguous() or cast.shape != param.shape
            or not cast.is_contiguous() or cast.storage_offset() != 0):
        return None
    return param


def _pack(saved: torch.Tensor):
    param = cast_parameter(saved)
    return saved if param is None else _Recast(param, saved)


def _unpack(packed):
    return packed.tensor() if isinstance(packed, _Recast) else packed


def recast_saved_weights() -> torch.autograd.graph.saved_tensors_hooks:
    """The context to run a mixed-precision training forward in: casts of trainable float32 weights saved for the
    backward pass are dropped after the forward and cast again in the backward."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


def recasts_weights(precision: object, device: torch.device, model: torch.nn.Module) -> bool:
    """Whether a training forward of ``model`` runs in ``recast_saved_weights``: ``bf16-mixed`` on the CPU (where it
    was measured bitwise equal to autocast's own backward), model not compiled (saved-tensor hooks and
    ``torch.compile`` are not combined here)."""
    compiled = getattr(model, "_compiled_call_impl", None) is not None or hasattr(model, "_orig_mod")
    return str(precision) == "bf16-mixed" and torch.device(device).type == "cpu" and not compiled
