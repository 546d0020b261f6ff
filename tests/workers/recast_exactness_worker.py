"""Whether ``recast_saved_weights`` gives autocast's own outputs and gradients bit for bit, for
tests/training/test_bf16_memory.py (run in the test's process and, for other kernels, in a fresh one with
``ATEN_CPU_CAPABILITY``/``ONEDNN_MAX_CPU_ISA`` set).

``python recast_exactness_worker.py`` prints one JSON line: how many saved weight casts the backward passes recast,
and for each case whether the outputs, the input's gradient and every parameter's gradient under bf16 autocast are
bitwise equal with and without the hooks (and the largest absolute difference where not). The cases are constructed
(seeded weights and inputs): linears on 3-D and 2-D inputs, with and without bias; a weight used twice in one forward
(a tied weight, autocast's cache gives both products the same cast); a product with a view of a cast weight
(``x @ w.T``); a bf16 weight that is no cast (kept as saved).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from lightalign.modules.training import recast_weights


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(96, 48) / 7)
        self.b16 = torch.nn.Parameter(torch.randn(48, 48).to(torch.bfloat16))

    def forward(self, x):
        h = F.linear(x, self.w.T.contiguous() @ self.w / 9)  # a product of the weight with itself, then a linear
        h = F.silu(h) @ self.b16.float().T  # a cast of a bf16 leaf (not a float32 one: kept)
        return F.linear(h, self.w) + (x @ self.w.T)  # the same weight twice and a view of its cast


def cases() -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64, bias=False),
                              torch.nn.Linear(64, 300))
    return {"linears 3-D": (mlp, torch.randn(3, 7, 64)), "linears 2-D": (mlp, torch.randn(21, 64)),
            "tied and viewed": (Tied(), torch.randn(2, 5, 48))}


def step(model: torch.nn.Module, x: torch.Tensor, hooks: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with recast_weights.recast_saved_weights() if hooks else torch.enable_grad():
            y = model(x)
        loss = (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()
    loss.backward()
    return [y, x.grad] + [p.grad for p in model.parameters()]


def report() -> dict:
    """The JSON line's content (``_Recast.tensor`` counted while it runs)."""
    recasts = 0
    tensor = recast_weights._Recast.tensor

    def counted(self):
        nonlocal recasts
        recasts += 1
        return tensor(self)

    recast_weights._Recast.tensor = counted
    try:
        out = {}
        for name, (model, x) in cases().items():
            plain, hooked = step(model, x, False), step(model, x, True)
            out[name] = {"equal": all(torch.equal(a, b) for a, b in zip(plain, hooked, strict=True)),
                         "max_abs_diff": max((a.float() - b.float()).abs().max().item()
                                             for a, b in zip(plain, hooked, strict=True))}
    finally:
        recast_weights._Recast.tensor = tensor
    return {"recasts": recasts, "cases": out, "capability": torch.backends.cpu.get_cpu_capability()}


if __name__ == "__main__":
    print(json.dumps(report()))
