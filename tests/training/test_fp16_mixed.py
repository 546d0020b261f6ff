"""``16-mixed`` precision (CUDA only: Lightning turns it into bf16-mixed on CPU), checked at the module's hooks
with a stand-in trainer: the gradient scaler owns overflow handling and clipping of scaled gradients."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightalign import SFTModule


class SingleDeviceStrategy:  # the name is what the module's fast clipping path looks at
    pass


def _module(tiny_model, precision: str) -> tuple[SFTModule, SimpleNamespace]:
    module = SFTModule(model=tiny_model, nonfinite="stop")
    trainer = SimpleNamespace(precision=precision, world_size=1, strategy=SingleDeviceStrategy(), global_step=0,
                              current_epoch=0, fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_idx=0)))
    module._trainer = trainer
    module.configure_callbacks()  # the NonFiniteGuard, as Lightning adds it
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    next(module.parameters()).grad[0] = float("inf")  # what an fp16 overflow looks like before the scaler's check
    return module, trainer


def test_fp16_overflow_is_left_to_the_gradient_scaler(tiny_model):
    module, trainer = _module(tiny_model, "16-mixed")
    module.nonfinite_guard.on_before_optimizer_step(trainer, module, None)  # the scaler skips the step itself
    assert all(p.grad is not None for p in module.parameters()) and module.nonfinite_steps == 0
    module, trainer = _module(tiny_model, "32-true")
    with pytest.raises(FloatingPointError, match="Non-finite gradient"):  # other precisions: the guard acts
        module.nonfinite_guard.on_before_optimizer_step(trainer, module, None)


def test_fp16_clipping_goes_through_lightning(tiny_model, monkeypatch):
    calls = []
    monkeypatch.setattr(L.LightningModule, "configure_gradient_clipping",
                        lambda self, optimizer, val=None, algorithm=None: calls.append(val))
    for precision, through_lightning in (("16-mixed", True), ("32-true", False)):
        module, _ = _module(tiny_model, precision)
        for p in module.parameters():
            p.grad = torch.ones_like(p)
        grads = [p.grad for p in module.parameters()]
        module.nonfinite_guard.grad_norms = (grads, torch.stack(torch._foreach_norm(grads)))  # as the guard leaves them
        calls.clear()
        module.configure_gradient_clipping(None, 1.0, "norm")
        assert calls == ([1.0] if through_lightning else []), precision
