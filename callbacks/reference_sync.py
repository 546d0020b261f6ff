"""``ReferenceSync``: the callback behind ``sync_ref_model`` (TR-DPO; the mixing itself is
``mix_into_reference``). Added by the module (``PolicyModule.configure_callbacks``) when the knob is on.

After every ``every``-th optimizer step the reference takes ``alpha * policy + (1 - alpha) * reference``. The
mixed reference is no longer a function of the initial weights, so checkpoints carry it (this callback's state)
and a ``--ckpt_path`` resume puts it back: the resumed run sees the reference the uninterrupted one would.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lightalign.modules.reference.sync import check_mixable, mix_into_reference, refuse_sharded_reference


class ReferenceSync(L.Callback):
    def __init__(self, alpha: float, every: int) -> None:
        self.alpha, self.every = float(alpha), int(every)
        self.syncs = 0
        self.last_step = 0
        self._module: Any = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._module = pl_module
        refuse_sharded_reference(trainer.strategy)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        check_mixable(pl_module.model, pl_module.ref_model)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self.last_step or step % self.every:
            return
        mix_into_reference(pl_module.model, pl_module.ref_model, self.alpha)
        self.syncs += 1
        self.last_step = step

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"syncs": self.syncs, "last_step": self.last_step}
        ref = getattr(self._module, "ref_model", None)
        if self.syncs and ref is not None:
            state["reference"] = {n: p.detach().to("cpu", copy=True) for n, p in ref.named_parameters()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.syncs, self.last_step = int(state_dict["syncs"]), int(state_dict["last_step"])
        weights = state_dict.get("reference")
        if weights is None:
            return
        ref = getattr(self._module, "ref_model", None)
        if ref is None:
            raise ValueError("This checkpoint holds a synced reference (sync_ref_model) but the resumed run has no "
                             "reference model to put it in; resume with the settings that wrote it.")
        with torch.no_grad():
            for name, param in ref.named_parameters():
                param.copy_(weights[name].to(param.device, param.dtype))
