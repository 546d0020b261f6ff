"""``BEMAReference``: the callback behind ``update_ref_model`` (a BEMA reference; the state and its arithmetic are
``BEMAWeights``). Added by the module (``PolicyModule.configure_callbacks``) when the knob is on.

At fit start it snapshots the policy (``theta_0``, the EMA, the average); after every optimizer step it runs TRL's
schedule (``BEMAWeights.step``, then the copy into the reference when ``reference_due``). The state is no function of
the initial weights alone, so checkpoints carry it, and the reference once it has been rewritten: a ``--ckpt_path``
resume puts both back and the resumed run sees the averages and the reference the uninterrupted one would.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lightalign.modules.reference.bema import BEMAKnobs, BEMAWeights, averaged_parameters
from lightalign.modules.reference.sync import check_mixable, refuse_sharded_reference


class BEMAReference(L.Callback):
    def __init__(self, knobs: BEMAKnobs) -> None:
        self.knobs = knobs
        self.weights: BEMAWeights | None = None
        self.last_step = 0
        self.updates = 0  # updates of the average
        self.reference_updates = 0
        self._restored: dict[str, Any] | None = None
        self._module: Any = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        refuse_sharded_reference(trainer.strategy, "update_ref_model")

    def buffer_device(self, pl_module: L.LightningModule) -> torch.device:
        """``device``: 'cpu', or the accelerator's type meaning this rank's own device."""
        device = torch.device(self.knobs.device)
        if device.index is None and device.type == pl_module.device.type:
            return pl_module.device
        return device

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        check_mixable(pl_module.model, pl_module.ref_model, "update_ref_model")
        self._module = pl_module
        if self.weights is None:  # a fresh fit: the initial policy (a resume's is overwritten by its checkpoint)
            names = averaged_parameters(pl_module.model, pl_module.ref_model)
            self.weights = BEMAWeights(self.knobs, pl_module.model, names, self.buffer_device(pl_module))
        state, self._restored = self._restored, None
        if state is None:
            return
        self.weights.load_state_dict(state)
        reference = state.get("reference")
        if reference is not None:
            with torch.no_grad():
                for name, param in pl_module.ref_model.named_parameters():
                    param.copy_(reference[name])

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self.last_step:  # no optimizer step since (accumulation)
            return
        self.last_step = step
        self.updates += self.weights.step(pl_module.model, step)
        if self.weights.reference_due(step):
            self.weights.copy_into(pl_module.ref_model)
            self.reference_updates += 1

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"last_step": self.last_step, "updates": self.updates,
                                 "reference_updates": self.reference_updates}
        if self.weights is not None:
            state.update({k: {n: t.to("cpu", copy=True) for n, t in v.items()}
                          for k, v in self.weights.state_dict().items()})
        ref = getattr(self._module, "ref_model", None)
        if self.reference_updates and ref is not None:
            state["reference"] = {n: p.detach().to("cpu", copy=True) for n, p in ref.named_parameters()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_step = int(state_dict["last_step"])
        self.updates, self.reference_updates = int(state_dict["updates"]), int(state_dict["reference_updates"])
        if "theta0" in state_dict:
            self._restored = state_dict  # applied at fit start, once the policy is restored and the state built
