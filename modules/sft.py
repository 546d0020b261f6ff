"""Supervised fine-tuning: ``sft_loss`` (pure tensors) and ``SFTModule`` (model, loss and metrics wired)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics.aggregation import MeanMetric, SumMetric

from lightalign.knobs import takes_knobs
from lightalign.modules.training.neftune import NEFTuneKnobs
from lightalign.modules.training.policy import PolicyModule
from lightalign.modules.training.sft_forward import sft_logits

from lightalign.datamodules.collators import IGNORE_INDEX  # (defined once: the label the collators write)


def sft_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token cross-entropy over the target tokens (``labels != -100``).

    ``logits`` is ``[batch, seq, vocab]`` and ``labels`` ``[batch, seq]``, aligned with the inputs (the shift
    happens here). The summed negative log-likelihood is divided by ``num_items_in_batch`` — the number of
    target tokens in the whole optimizer step — or, when it is ``None``, by this batch's own target count.
    Only target positions are gathered before the (float32) log-softmax, so no full ``[batch, seq, vocab]``
    float32 copy is made.

    Returns the loss and stats: ``nll_sum``, ``num_tokens`` (targets here), ``num_correct`` (argmax hits).
    """
    shift_logits = logits[:, :-1, :]
    shift_labels = labels[:, 1:]
    mask = shift_labels != IGNORE_INDEX
    target_logits = shift_logits[mask].float()
    targets = shift_labels[mask]
    nll_sum = F.cross_entropy(target_logits, targets, reduction="sum")
    num_tokens = mask.sum()
    with torch.no_grad():
        num_correct = (target_logits.argmax(dim=-1) == targets).sum()
    denom = num_tokens if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=logits.device)
    loss = nll_sum / denom.clamp(min=1)
    return loss, {"nll_sum": nll_sum.detach(), "num_tokens": num_tokens, "num_correct": num_correct}


@takes_knobs(NEFTuneKnobs)
class SFTModule(PolicyModule):
    """Supervised fine-tuning of a causal LM on the batches of ``SFTDataModule``.

    The loss of an optimizer step is the mean over all target tokens of all its micro-batches (and all ranks),
    so ``accumulate_grad_batches=4`` with batch 2 gives the gradient of one batch of 8. Logged once per
    optimizer step: ``train/loss``, ``train/token_accuracy``, ``train/tokens_seen``; per validation epoch:
    ``val/loss``, ``val/perplexity``, ``val/token_accuracy`` (``test/…`` likewise).

    Its knobs are ``PolicyModule``'s (model loading, LoRA, optimizer, schedule, ``eval_metrics`` — which receive
    the argmax token and the target token of every target position); the data knobs (``max_length``, ``packing``)
    are ``SFTDataModule``'s.
    """

    takes_images = True  # rows with images: every forward reads them (tests/vision)

    method_name = "SFT"

    def compose(self) -> None:
        super().compose()
        self.train_loss = MeanMetric()
        self.train_accuracy = MeanMetric()
        self.train_tokens = SumMetric()
        self.eval_loss = MeanMetric()
        self.eval_accuracy = MeanMetric()
        self.tokens_seen = 0

    def batch_layout(self) -> tuple[str, int | None]:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        layout = ("packed" if getattr(datamodule, "packing", False)
                  else "padding_free" if getattr(datamodule, "padding_free", False) else "padded")
        return layout, getattr(datamodule, "max_length", None)

    # ------------------------------------------------------------------------------------- forward
    def _logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return sft_logits(self.model, batch)

    def _step_denominator(self, batch: dict[str, torch.Tensor], local_tokens: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Target tokens of the whole optimizer step, and the factor that undoes Lightning's and DDP's averaging."""
        group_tokens = batch.get("num_items_in_batch")
        if group_tokens is None:  # a loader that does not count ahead: per-micro-batch mean
            return local_tokens, 1.0
        group_tokens = torch.as_tensor(group_tokens, device=local_tokens.device)
        world = self.trainer.world_size if self._trainer is not None else 1
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        if world > 1:
            group_tokens = self.trainer.strategy.reduce(group_tokens.float(), reduce_op="sum")
        return group_tokens, float(accumulate * world)

    def compute_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor],
                     num_items_in_batch: torch.Tensor | int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The training loss of one micro-batch and its stats (``sft_loss``). Override to change the loss only:
        the accumulation scaling, metrics and logging of ``training_step`` stay as they are."""
        return sft_loss(logits, batch["labels"], num_items_in_batch=num_items_in_batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        local_tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        denom, scale = self._step_denominator(batch, local_tokens)
        with self.training_forward_context():
            logits = self._logits(batch)
        loss, stats = self.compute_loss(logits, batch, num_items_in_batch=denom)
        n = stats["num_tokens"].clamp(min=1)
        self.train_loss.update(stats["nll_sum"] / n, weight=stats["num_tokens"])
        self.train_accuracy.update(stats["num_correct"] / n, weight=stats["num_tokens"])
        self.train_tokens.update(count_input_tokens(batch))
        return self.add_router_aux_loss(loss * scale)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Called once per optimizer step, after the last micro-batch's backward: log the step's aggregates.
        super().on_before_optimizer_step(optimizer)
        self.tokens_seen += int(self.train_tokens.compute().item())
        self.log("train/loss", self.train_loss.compute(), on_step=True, prog_bar=True)
        self.log("train/token_accuracy", self.train_accuracy.compute(), on_step=True)
        self.log("train/tokens_seen", float(self.tokens_seen), on_step=True)
        for metric in (self.train_loss, self.train_accuracy, self.train_tokens):
            metric.reset()

    # ------------------------------------------------------------------------------------- eval
    def _eval_step(self, batch: dict[str, torch.Tensor]) -> None:
        logits = self._logits(batch)
        _, stats = sft_loss(logits, batch["labels"])
        n = stats["num_tokens"].clamp(min=1)
        if self.eval_metric_objects or self.eval_metric_fns:
            # eval_metrics see the argmax prediction and the target of every target token: (preds [N], target [N])
            mask = batch["labels"][:, 1:] != IGNORE_INDEX
            self.update_eval_metrics(logits[:, :-1].argmax(-1)[mask], batch["labels"][:, 1:][mask])
        self.eval_loss.update(stats["nll_sum"] / n, weight=stats["num_tokens"])
        self.eval_accuracy.update(stats["num_correct"] / n, weight=stats["num_tokens"])

    def _eval_epoch_end(self, stage: str) -> None:
        loss = self.eval_loss.compute()
        self.log(f"{stage}/loss", loss, prog_bar=True)
        self.log(f"{stage}/perplexity", torch.exp(loss.clamp(max=math.log(1e30))))
        self.log(f"{stage}/token_accuracy", self.eval_accuracy.compute())
        self.eval_loss.reset()
        self.eval_accuracy.reset()
        self.log_eval_metrics(stage)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    # ------------------------------------------------------------------------------------- state
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["lightalign"] = {"tokens_seen": self.tokens_seen}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.tokens_seen = int(checkpoint.get("lightalign", {}).get("tokens_seen", 0))


def count_input_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Non-padding input tokens of a batch (every token of a padding-free batch)."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    return torch.tensor(batch["input_ids"].numel(), device=batch["input_ids"].device)
