"""``RunSummary``: a short table at the end of fit — steps, tokens, time, throughput, metrics, where things went."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from lightalign.callbacks.throughput import batch_tokens

#: Metrics worth a line in the summary (any stage, any method), with which way is better ("min" or "max"): their
#: final and best values. A method adds its own in ``summary_stats`` (e.g. distillation's ``divergence``).
SUMMARY_KEYS = {"loss": "min", "perplexity": "min", "token_accuracy": "max", "rewards/accuracies": "max",
                "rewards/margins": "max", "reward/mean": "max", "kl": "min"}


def summary_keys(pl_module: Any) -> dict[str, str]:
    """The summary's metrics for ``pl_module``: the shared ones and its method's ``summary_stats``."""
    return {**SUMMARY_KEYS, **getattr(pl_module, "summary_stats", {})}


class RunSummary(L.Callback):
    """Print, from rank 0, a table at the end of fit (also kept as ``self.table`` and ``self.values``).

    Tokens are the non-padding tokens trained on, summed over ranks. Best values are taken over every logged
    value of the run (minimum for losses, perplexity, KL and a method's divergences, maximum otherwise:
    ``summary_keys``), with the step they were seen at.
    The table covers the whole run: its tallies are checkpointed, so a resumed run adds to those of the steps
    before the checkpoint (wall time: the time spent in fit, every attempt's up to its checkpoint).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.table = ""
        self.values: dict[str, Any] = {}
        self._start = 0.0
        self._tokens = 0
        self._step = -1
        self._final: dict[str, tuple[int, float]] = {}
        self._best: dict[str, tuple[int, float]] = {}
        self._earlier_seconds = 0.0  # fit time of the run before the checkpoint it resumed from
        self._resumed_at: int | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # before a checkpoint's tallies are loaded (load_state_dict)
            self._tokens, self._earlier_seconds, self._resumed_at = 0, 0.0, None
            self._final, self._best = {}, {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start, self._step = time.perf_counter(), trainer.global_step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = trainer.global_step  # restored by now under every strategy

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "tokens": int(self._tokens), "seconds": self._earlier_seconds + time.perf_counter() - self._start,
                "final": {k: list(v) for k, v in self._final.items()},
                "best": {k: list(v) for k, v in self._best.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._tokens = int(state_dict.get("tokens", 0))
        self._earlier_seconds = float(state_dict.get("seconds", 0.0))
        self._final = {k: (int(v[0]), float(v[1])) for k, v in state_dict.get("final", {}).items()}
        self._best = {k: (int(v[0]), float(v[1])) for k, v in state_dict.get("best", {}).items()}
        self._resumed_at = int(state_dict.get("step", 0))

    def _record(self, trainer: L.Trainer, pl_module: L.LightningModule, stages: tuple[str, ...]) -> None:
        keys = summary_keys(pl_module)
        for name, value in trainer.callback_metrics.items():
            stage, _, key = name.partition("/")
            if stage not in stages or key not in keys:
                continue
            value = float(value)
            self._final[name] = (trainer.global_step, value)
            best = self._best.get(name)
            lower = keys[key] == "min"
            if best is None or (value < best[1] if lower else value > best[1]):
                self._best[name] = (trainer.global_step, value)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._tokens += getattr(pl_module, "last_batch_tokens", None) or batch_tokens(batch)
        if trainer.global_step != self._step:  # an optimizer step ended: its metrics are logged
            self._step = trainer.global_step
            self._record(trainer, pl_module, ("train",))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._record(trainer, pl_module, ("val",))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        tokens = torch.tensor(float(self._tokens), dtype=torch.float64, device=pl_module.device)
        if trainer.world_size > 1:
            tokens = trainer.strategy.reduce(tokens, reduce_op="sum")
        if not trainer.is_global_zero:
            return
        seconds = self._earlier_seconds + time.perf_counter() - self._start
        self.values = {"steps": trainer.global_step, "tokens": int(tokens.item()), "seconds": seconds,
                       "tokens_per_sec": tokens.item() / max(seconds, 1e-9),
                       "final": {k: v for k, (_, v) in self._final.items()},
                       "best": {k: v for k, (_, v) in self._best.items()}}
        steps = f"{trainer.global_step:,}" + (f" (resumed at step {self._resumed_at:,})" if self._resumed_at else "")
        rows = [("steps", steps), ("tokens", f"{self.values['tokens']:,}"),
                ("wall time", f"{seconds:.1f} s"), ("tokens/s (wall)", f"{self.values['tokens_per_sec']:,.0f}")]
        for name in sorted(self._final, key=lambda n: (n.partition("/")[2], n)):
            best_step, best = self._best[name]
            rows.append((name, f"final {self._final[name][1]:.4g}   best {best:.4g} (step {best_step})"))
        for label, path in self._outputs(trainer):
            rows.append((label, str(path)))
        width = max(len(label) for label, _ in rows)
        self.table = "\n".join(["lightalign run summary"] + [f"  {label.ljust(width)}  {text}" for label, text in rows])
        print(self.table, flush=True)

    @staticmethod
    def _outputs(trainer: L.Trainer) -> list[tuple[str, Any]]:
        out = []
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None and (checkpoint.last_model_path or checkpoint.best_model_path):
            out.append(("checkpoint", checkpoint.last_model_path or checkpoint.best_model_path))
        for callback in trainer.callbacks:
            if getattr(callback, "last_export", None) is not None:
                out.append(("HF export", callback.last_export))
            if getattr(callback, "last_path", None) is not None and str(callback.last_path).endswith(".png"):
                out.append(("curves", callback.last_path))
        return out
