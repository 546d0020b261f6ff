"""Callbacks the RLOO and PPO tests share: move the policy off its reference, keep every rollout buffer."""

from __future__ import annotations

import lightning as L
import torch


class PerturbPolicy(L.Callback):
    """Moves the policy away from its reference copy before the first rollout, so the KL is not zero."""

    def on_fit_start(self, trainer, pl_module):
        torch.manual_seed(1)
        with torch.no_grad():
            for p in pl_module.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)


class KeepBuffer(L.Callback):
    """Every rollout buffer the module trained on, in order."""

    def __init__(self):
        self.buffers = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.buffers or self.buffers[-1] is not pl_module.rollout_buffer.chunks:
            self.buffers.append(pl_module.rollout_buffer.chunks)
