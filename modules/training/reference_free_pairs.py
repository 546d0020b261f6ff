"""``ReferenceFreePairModule``: what the reference-free preference methods (``CPOModule``, ``ORPOModule``) share on
the pair batches of ``PreferenceDataModule``: one policy forward per batch, the summed completion log-probs and
completion lengths of every chosen and rejected completion, the method's pair loss on them, and TRL's statistics.

No reference model is loaded and no reference pass runs: the loss reads the policy's log-probs only. Both batch
layouts (shared-prompt, the default, and the classic padded one) give the same log-probs (``completion_token_logps``),
so the same loss.
"""

from __future__ import annotations

import torch
from torchmetrics.aggregation import MeanMetric

from lightalign.modules.losses.implicit_reward import REWARD_STATS, reward_stats
from lightalign.modules.training.policy import PolicyModule
from lightalign.modules.training.preference_forward import (
    completion_lengths,
    completion_token_logps,
    pair_batch_layout,
    pair_count,
    real_token_count,
    warn_long_shared_rows,
)
from lightalign.modules.training.stat_hooks import StatHooks

PAIR_LOSS_STATS = ("loss", *REWARD_STATS, "logps/chosen", "logps/rejected", "nll_loss")


class ReferenceFreePairModule(StatHooks, PolicyModule):
    """Base of a preference method whose loss reads the policy alone: a subclass supplies ``pair_loss`` and lists
    the statistics it logs (``logged_stats``: TRL's names, logged as ``train/<name>`` per optimizer step and
    ``val/<name>`` per validation epoch). ``eval_metrics`` receive ``sigmoid(reward margin)`` and a target of ones.
    """

    logged_stats: tuple[str, ...] = PAIR_LOSS_STATS

    def pair_loss(self, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor,
                  rejected_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """``(loss, chosen_rewards [B], rejected_rewards [B], stats)`` of summed completion log-probs ``[B]`` and
        completion token counts ``[B]`` (the method's loss function, given its knob group)."""
        raise NotImplementedError

    def compose(self) -> None:
        super().compose()
        self.train_stats = torch.nn.ModuleDict({k.replace("/", "_"): MeanMetric() for k in self.logged_stats})
        self.eval_stats = torch.nn.ModuleDict({k.replace("/", "_"): MeanMetric() for k in self.logged_stats})

    def _step(self, batch: dict[str, torch.Tensor], stats: torch.nn.ModuleDict) -> torch.Tensor:
        token_logps, _ = completion_token_logps(self.model, batch)  # the batch's one forward
        sums = token_logps.sum(-1)
        half = sums.shape[0] // 2
        chosen_lengths, rejected_lengths = completion_lengths(batch)
        loss, chosen_rewards, rejected_rewards, extra = self.pair_loss(sums[:half], sums[half:], chosen_lengths,
                                                                       rejected_lengths)
        values = {"loss": loss.detach(), **reward_stats(chosen_rewards, rejected_rewards), **extra}
        n = float(chosen_lengths.shape[0])
        for key in self.logged_stats:
            stats[key.replace("/", "_")].update(values[key], weight=n)
        if stats is self.eval_stats and (self.eval_metric_objects or self.eval_metric_fns):
            preference = torch.sigmoid(chosen_rewards - rejected_rewards)  # Bradley-Terry P(chosen > rejected)
            self.update_eval_metrics(preference, torch.ones_like(preference, dtype=torch.long))
        return loss

    def _log_stats(self, stats: torch.nn.ModuleDict, stage: str) -> None:
        for key in self.logged_stats:
            metric = stats[key.replace("/", "_")]
            self.log(f"{stage}/{key}", metric.compute(), prog_bar=key in ("loss", "rewards/accuracies"))
            metric.reset()

    def batch_layout(self) -> tuple[str, int | None]:
        return pair_batch_layout(getattr(self.trainer, "datamodule", None) if self._trainer is not None else None)

    def on_fit_start(self) -> None:
        warn_long_shared_rows(getattr(self.trainer, "datamodule", None), self.model)
        super().on_fit_start()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.last_batch_tokens, self.last_batch_samples = real_token_count(batch), pair_count(batch)
        with self.training_forward_context():
            loss = self._step(batch, self.train_stats)
        return self.add_router_aux_loss(loss)
