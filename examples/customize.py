"""Customization examples referenced by docs/customize.md (each one is exercised by tests/training/test_customize.py).

From YAML, name them by import path with this folder on PYTHONPATH, e.g.
``PYTHONPATH=examples lightalign fit ... --trainer.callbacks+=customize.StopAfterSteps``.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from lightalign import SFTDataModule, SFTModule


# ----------------------------------------------------------------------------------------------- callbacks
class StepLogger(L.Callback):
    """Print (and keep) the loss of every optimizer step."""

    def __init__(self, print_every: int = 1) -> None:
        self.print_every = print_every
        self.history: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None and (not self.history or self.history[-1][0] != trainer.global_step):
            self.history.append((trainer.global_step, float(loss)))
            if trainer.global_step % self.print_every == 0:
                print(f"step {trainer.global_step}: loss {float(loss):.4f}")


class StopAfterSteps(L.Callback):
    """Stop training after ``steps`` optimizer steps (Lightning finishes the current step cleanly)."""

    def __init__(self, steps: int = 10) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


# ----------------------------------------------------------------------------------------------- subclassing
class WeightedTokenSFT(SFTModule):
    """The loss: per-token weights by target token id (e.g. count the EOS token double)."""

    def __init__(self, *args, token_weights: dict[int, float] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.token_weights = token_weights or {}

    def compute_loss(self, logits, batch, num_items_in_batch=None):
        _, stats = super().compute_loss(logits, batch, num_items_in_batch)  # keep the logged stats
        labels = batch["labels"][:, 1:]
        mask = labels != -100
        nll = F.cross_entropy(logits[:, :-1][mask].float(), labels[mask], reduction="none")
        w = torch.tensor([self.token_weights.get(int(t), 1.0) for t in labels[mask]], device=nll.device)
        denom = stats["num_tokens"] if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
        return (nll * w).sum() / denom.clamp(min=1), stats


class SGDSFT(SFTModule):
    """The optimizer factory: SGD with momentum; the warmup/decay schedule of the module still applies."""

    def create_optimizer(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=self.hparams.learning_rate, momentum=0.9)


class GradNormSFT(SFTModule):
    """The per-step hook: log the gradient norm of every optimizer step (next to train/loss)."""

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)  # keeps train/loss & co.
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.log("train/grad_norm", torch.stack(torch._foreach_norm(grads)).norm(), on_step=True)


class MinTargetsSFTData(SFTDataModule):
    """The dataloader: drop rows with fewer than ``min_targets`` loss tokens from every training batch."""

    def __init__(self, *args, min_targets: int = 4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.min_targets = min_targets

    def default_collator(self):
        collate = super().default_collator()
        keep = lambda row: sum(row["completion_mask"]) >= self.min_targets  # noqa: E731
        return lambda rows: collate([r for r in rows if keep(r)] or rows[:1])
