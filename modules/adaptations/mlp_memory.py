"""Gated SiLU MLPs that keep one activation tensor less for the backward pass: ``recompute_mlp_activation``.

Llama-style MLPs (Llama, Qwen2/3, Mistral …) compute ``down(silu(gate(x)) * up(x))``. Eager autograd keeps four
``[tokens, intermediate_size]`` tensors of it until the backward pass: ``gate(x)`` (for SiLU's gradient),
``silu(gate(x))`` and ``up(x)`` (for the product's), and the product (``down``'s input, for its weight gradient).
``silu_mul`` keeps only ``gate(x)`` and ``up(x)`` and recomputes ``silu(gate(x))`` in the backward pass (the idea of
Liger's SwiGLU kernel, here in plain PyTorch so it runs on any device): a quarter of the MLP's activation memory,
``layers * tokens * intermediate_size`` elements, for one elementwise SiLU per layer in the backward pass. Values
and gradients are bitwise those of the eager module (the same ATen ops on the same operands).

Only MLPs that have exactly that structure are switched, per instance: ``gate_proj``, ``up_proj`` and
``down_proj`` submodules, a SiLU ``act_fn``, nothing else (no dropout, no other submodule or parameter), and a
``forward`` whose compiled code is that of the expression (its bytecode and the names it reads, not its source
text: a forward that does anything more, e.g. a dropout after ``down_proj``, is left alone). Parameter names,
state dicts, checkpoints and the Hugging Face export do not change, and the projections are still called as
modules (LoRA adapters, FSDP and DeepSpeed hooks see them as before). ``mlp_report`` says which MLPs of a model
were switched and why the others were not (fused ``gate_up_proj``, experts, GELU ...).

The switch is an instance attribute (``module.forward``) on the MLPs of the model it is given, nothing class- or
process-wide; an MLP whose forward was already replaced on the instance (by anyone) is left alone, so the original
is always the class's own ``forward``. ``restore_mlp_forward`` takes the switch back (``PolicyModule`` does so at
teardown for a model the user passed in).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F



def _expression(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _expression_named(self, x):  # transformers' own spelling (Llama, Qwen2/3, Mistral, Gemma ...)
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


_GATED_CODES = [f.__code__ for f in (_expression, _expression_named)]
_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}


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


def _same_code(code, reference) -> bool:
    """The same instructions reading the same attribute names (argument names and line numbers may differ)."""
    return (code.co_code == reference.co_code and code.co_names == reference.co_names
            and code.co_argcount == reference.co_argcount
            and [c for c in code.co_consts if not isinstance(c, str)] == [c for c in reference.co_consts
                                                                         if not isinstance(c, str)])


def why_not_gated_silu(module: torch.nn.Module) -> str | None:
    """None if ``module`` is a gated SiLU MLP with exactly the structure ``silu_mul`` reproduces; else why not."""
    children = set(dict(module.named_children()))
    if not {"gate_proj", "up_proj", "down_proj"} <= children:
        return "no separate gate_proj/up_proj/down_proj"
    if children != _PARTS or any(True for _ in module.named_parameters(recurse=False)) or any(
            True for _ in module.named_buffers(recurse=False)):
        return f"other parts besides gate/up/down projections and act_fn: {sorted(children - _PARTS)}"
    if "forward" in vars(module) and not _is_lean(module):
        return "its forward was replaced on the instance"
    if not _is_silu(getattr(module, "act_fn", None)):
        return f"activation {type(getattr(module, 'act_fn', None)).__name__}, not SiLU"
    code = getattr(type(module).forward, "__code__", None)
    if code is None or not any(_same_code(code, ref) for ref in _GATED_CODES):
        return "its forward computes more than down(silu(gate(x)) * up(x))"
    return None


_FFN_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn")  # a decoder layer's feed-forward block


@dataclass
class MLPReport:
    switched: int = 0
    total: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # class name -> why it was left alone

    def describe(self) -> str:
        text = f"{self.switched}/{self.total} MLPs"
        if self.skipped:
            text += " (" + "; ".join(f"{k}: {v}" for k, v in self.skipped.items()) + ")"
        return text


def mlp_report(model: torch.nn.Module) -> MLPReport:
    """How many feed-forward blocks ``recompute_mlp_activation`` switched, of how many, and why the others were
    not (by class). Counted: each decoder layer's feed-forward block (``mlp``, ``feed_forward``, ...), and any
    other switched module (e.g. a shared expert)."""
    report = MLPReport()
    for name, module in model.named_modules():
        is_ffn = name.rsplit(".", 1)[-1] in _FFN_NAMES
        if _is_lean(module):
            report.switched += 1
            report.total += 1
        elif is_ffn:
            report.total += 1
            report.skipped.setdefault(type(module).__name__, why_not_gated_silu(module) or "not switched")
    return report


def _is_lean(module: torch.nn.Module) -> bool:
    return getattr(vars(module).get("forward"), "__func__", None) is _lean_forward


def recompute_mlp_activation(model: torch.nn.Module) -> int:
    """Switch every gated SiLU MLP of ``model`` to ``silu_mul`` (see the module docstring); returns how many."""
    count = 0
    for module in model.modules():
        if _is_lean(module) or why_not_gated_silu(module) is not None:
            continue
        module.forward = types.MethodType(_lean_forward, module)
        count += 1
    return count


def restore_mlp_forward(model: torch.nn.Module) -> int:
    """Give every MLP of ``model`` switched by ``recompute_mlp_activation`` its own forward back (the class's: the
    switch never replaces another instance forward); returns how many. Copies of a switched model (``deepcopy``,
    a reference model) are restored the same way."""
    count = 0
    for module in model.modules():
        if _is_lean(module):
            del module.forward
            count += 1
    return count
