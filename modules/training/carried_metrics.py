"""``CarriedStepMetrics``: the training metrics Lightning writes again on later steps, kept through a resume.

Within a training epoch Lightning's logger connector keeps every value a module logged (``self.log`` in a
training hook, ``on_step``) and hands it to the loggers again at every later step of that epoch until it is logged
anew: a statistic updated once per rollout (``train/reward/*``, ``train/completions/*``, ``train/tools/*``: scored
when the rollout is sampled, ``score_rollout``) appears in ``metrics.csv`` on each step that rollout
serves; a statistic logged on some steps only (``train/policy_loss``, ``train/kl``) stays at its last value. That
collection is not part of Lightning's checkpoints, so a run resumed mid-epoch wrote those columns empty until each
was logged again (the rest of a rollout, for GRPO with ``steps_per_generation`` x ``num_iterations`` > 1).

This callback (added by ``PolicyModule.configure_callbacks``) keeps those values in the checkpoint (its
``state_dict``: name, hook and ``self.log`` options, value) with the epoch they belong to, and on the first training
step of a run resumed in that epoch puts back the ones that step did not log itself, at its batch end, before
Lightning hands the step's metrics to the loggers: the loggers receive what the uninterrupted run's received.
Only plain tensors logged ``on_step`` without ``on_epoch`` are carried (an epoch aggregate would need its running
state; a logged ``torchmetrics.Metric`` is its own object); a value logged from ``on_train_batch_end`` by a hook
that runs after this callback's may be reset by Lightning on that step (its first log of that hook).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

KINDS = ("mean", "max", "min", "sum")


def _reduce_name(meta: Any) -> str | None:
    for kind in KINDS:
        if getattr(meta, f"is_{kind}_reduction"):
            return kind
    return None


class CarriedStepMetrics(L.Callback):
    """Keeps Lightning's carried-over training metrics (see the module docstring) through a checkpoint."""

    def __init__(self) -> None:
        self.pending: dict[str, Any] | None = None  # loaded from a checkpoint, put back on the first step

    @property
    def state_key(self) -> str:
        return "CarriedStepMetrics"

    def state_dict(self) -> dict[str, Any]:
        trainer = getattr(self, "_trainer", None)
        results = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "_results", None)
        if trainer is None or results is None:
            return {}
        carried = []
        for key, metric in results.items():
            meta = metric.meta
            value = metric._forward_cache
            if (metric.has_reset or not metric.is_tensor or not meta.on_step or meta.on_epoch
                    or not isinstance(value, torch.Tensor) or _reduce_name(meta) is None):
                continue
            carried.append({"fx": meta.fx, "name": meta.name, "value": value.detach().cpu().clone(),
                            "prog_bar": meta.prog_bar, "logger": meta.logger, "reduce_fx": _reduce_name(meta),
                            "enable_graph": meta.enable_graph, "add_dataloader_idx": meta.add_dataloader_idx,
                            "metric_attribute": meta.metric_attribute, "sync_dist": meta.sync.should,
                            "rank_zero_only": meta.sync.rank_zero_only})
        return {"epoch": trainer.current_epoch, "metrics": carried}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pending = dict(state_dict) if state_dict.get("metrics") else None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer  # state_dict is called without the trainer

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        pending, self.pending = self.pending, None
        if pending is None or pending.get("epoch") != trainer.current_epoch:
            return  # nothing carried, or the resumed run starts a new epoch (Lightning's collection starts empty)
        results = trainer.fit_loop.epoch_loop._results
        for entry in pending["metrics"]:
            key = f"{entry['fx']}.{entry['name']}"
            if key in results and not results[key].has_reset:
                continue  # logged by this step itself: its own value is the uninterrupted run's
            results.log(entry["fx"], entry["name"], entry["value"].to(pl_module.device), prog_bar=entry["prog_bar"],
                        logger=entry["logger"], on_step=True, on_epoch=False, reduce_fx=entry["reduce_fx"],
                        enable_graph=entry["enable_graph"], add_dataloader_idx=entry["add_dataloader_idx"],
                        sync_dist=entry["sync_dist"], sync_dist_fn=trainer.strategy.reduce,
                        metric_attribute=entry["metric_attribute"], rank_zero_only=entry["rank_zero_only"])
