"""Gated SiLU MLPs that keep one activation tensor less for the backward pass: ``recompute_mlp_activation``.

Llama-style MLPs (Llama, Qwen2/3, Mistral …) compute ``down(silu(gate(x)) * up(x))``. Eager autograd keeps four
``[tokens, intermediate_size]`` tensors of it until the backward pass: ``gate(x)`` (for SiLU's gradient),
``silu(gate(x))`` and ``up(x)`` (for the product's), and the product (``down``'s input, for its weight gradient).
``silu_mul`` keeps only ``gate(x)`` and ``up(x)`` and recomputes ``silu(gate(x))`` in the backward pass (the idea of
Liger's SwiGLU kernel, here in plain PyTorch so it runs on any device): a quarter of the MLP's activation memory,
``layers * tokens * intermediate_size`` elements, for one elementwise SiLU per layer in the backward pass. Values
and gradients are bitwise those of the eager module (the same ATen ops on the same operands).

Only MLPs whose ``forward`` is exactly that expression and whose activation is SiLU are switched, per instance:
parameter names, state dicts, checkpoints and the Hugging Face export do not change, and the projections are
still called as modules (LoRA adapters, FSDP and DeepSpeed hooks see them as before).
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.nn.functional as F

_GATED_FORWARD = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"


class _SiLUMul(torch.autograd.Function):
    """``silu(gate) * up``, saving ``gate`` and ``up`` only."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[1]:
            grad_up = grad * F.silu(gate)  # what eager's MulBackward computes for up
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)  # MulBackward, then SiluBackward
        return grad_gate, grad_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` with ``silu(gate)`` recomputed in the backward pass instead of kept."""
    return _SiLUMul.apply(gate, up)


def _lean_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _is_silu(act) -> bool:
    if isinstance(act, torch.nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # older transformers: ACT2FN["silu"] is torch.nn.SiLU
        return False
    return isinstance(act, SiLUActivation)


def _is_gated_silu_mlp(module: torch.nn.Module) -> bool:
    if not all(isinstance(getattr(module, name, None), torch.nn.Module)
               for name in ("gate_proj", "up_proj", "down_proj")) or not _is_silu(getattr(module, "act_fn", None)):
        return False
    forward = type(module).forward
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return _GATED_FORWARD in " ".join(source.split())


def recompute_mlp_activation(model: torch.nn.Module) -> int:
    """Switch every gated SiLU MLP of ``model`` to ``silu_mul`` (see the module docstring); returns how many."""
    count = 0
    for module in model.modules():
        switched = getattr(vars(module).get("forward"), "__func__", None) is _lean_forward
        if switched or not _is_gated_silu_mlp(module):
            continue
        module.forward = types.MethodType(_lean_forward, module)
        count += 1
    return count
