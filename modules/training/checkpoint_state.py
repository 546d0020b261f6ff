"""``PolicyModule``'s checkpoint seam: what a checkpoint holds beside the weights (every rank's random streams, the
method that wrote it) and the checks that a checkpoint belongs to this run's method and model."""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric

from lightalign.modules.training.lora import drop_quantization_state
from lightalign.modules.training.rng_state import gather_rng_states, set_rng_state


def check_state_dict_matches(saved: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> None:
    """A checkpoint of another model (other names or shapes) fails here, naming the first difference."""
    if not saved or not current:
        return
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing or unexpected:
        raise ValueError(
            f"The checkpoint holds another model: {len(missing)} parameter(s) of this model are missing from it "
            f"(e.g. {missing[:2]}) and it has {len(unexpected)} unknown one(s) (e.g. {unexpected[:2]}). Resume with the "
            "same model_name_or_path (and peft_config) that wrote it."
        )
    for key, value in saved.items():
        if hasattr(value, "shape") and tuple(value.shape) != tuple(current[key].shape):
            raise ValueError(
                f"The checkpoint holds another model: '{key}' has shape {tuple(value.shape)} there and "
                f"{tuple(current[key].shape)} here. Resume with the same model that wrote it."
            )


class CheckpointState:
    """Exact resume: the random streams continue where the checkpoint left them; a checkpoint of another method or
    model is refused before it is loaded."""

    def on_train_start(self) -> None:
        # A validate() before fit() runs under inference mode and leaves the metric states as inference
        # tensors, which training cannot update in place: start training from fresh states.
        for metric in self.modules():
            if isinstance(metric, Metric):
                metric.reset()
        # Exact resume: the random streams continue where the checkpoint left them (restored here, after the
        # sanity-check validation, which must not shift them).
        pending = getattr(self, "_pending_rng_states", None)
        if pending:
            set_rng_state(pending[min(self.global_rank, len(pending) - 1)])
            self._pending_rng_states = None
        self.continue_schedule()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["lightalign_rng"] = gather_rng_states()
        checkpoint["lightalign_meta"] = {"module": type(self).__name__}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        meta = checkpoint.get("lightalign_meta", {})
        written_by = meta.get("module")
        if written_by is not None and written_by != type(self).__name__:
            raise ValueError(
                f"This checkpoint was written by {written_by}, not {type(self).__name__}: a run resumes with the method "
                f"that wrote it. To start {type(self).__name__} from those weights, export them (the HFExport folder "
                "of that run) and pass the folder as model_name_or_path, without ckpt_path."
            )
        check_state_dict_matches(checkpoint.get("state_dict", {}), self.state_dict())
        drop_quantization_state(self, checkpoint.get("state_dict", {}))  # QLoRA
        self._pending_rng_states = checkpoint.get("lightalign_rng")
