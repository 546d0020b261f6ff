"""``ReferenceFreePairModule``: what the reference-free preference methods (``CPOModule``, ``ORPOModule``) share on
the pair batches of ``PreferenceDataModule``: one policy forward per batch, the summed completion log-probs and
completion lengths of every chosen and rejected completion, the method's pair loss on them, and TRL's statistics.

No reference model is loaded and no reference pass runs: the loss reads the policy's log-probs only. Every batch
layout (shared-prompt, the default, the classic padded one and padding-free) gives the same log-probs
(``completion_token_logps``), so the same loss. A method whose loss also reads the chosen sequences' prompt tokens
(ORPO's NLL over the whole chosen sequence) sets ``scores_chosen_prompt``: that forward then also gives their
summed log-probs and counts (``completion_and_prompt_logps``); the others compute nothing at the prompt positions.
"""

from __future__ import annotations

import torch

from lightalign.modules.losses.implicit_reward import REWARD_STATS, reward_stats
from lightalign.modules.training.policy import PolicyModule
from lightalign.modules.training.preference_forward import (
    completion_and_prompt_logps,
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
    scores_chosen_prompt: bool = False  # pair_loss also receives the chosen prompts' log-probs and counts

    def pair_loss(self, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor,
                  rejected_lengths: torch.Tensor, *prompt: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """``(loss, chosen_rewards [B], rejected_rewards [B], stats)`` of summed completion log-probs ``[B]`` and
        completion token counts ``[B]`` (the method's loss function, given its knob group); with
        ``scores_chosen_prompt``, ``prompt`` is the chosen sequences' summed prompt log-probs ``[B]`` and predicted
        prompt token counts ``[B]``."""
        raise NotImplementedError

    def compose(self) -> None:
        super().compose()
        self.build_stat_metrics()

    def _step(self, batch: dict[str, torch.Tensor], stats: torch.nn.ModuleDict) -> torch.Tensor:
        if self.scores_chosen_prompt:  # the batch's one forward
            token_logps, _, *prompt = completion_and_prompt_logps(self.model, batch)
        else:
            (token_logps, _), prompt = completion_token_logps(self.model, batch), []
        sums = token_logps.sum(-1)
        half = sums.shape[0] // 2
        chosen_lengths, rejected_lengths = completion_lengths(batch)
        loss, chosen_rewards, rejected_rewards, extra = self.pair_loss(sums[:half], sums[half:], chosen_lengths,
                                                                       rejected_lengths, *prompt)
        values = {"loss": loss.detach(), **reward_stats(chosen_rewards, rejected_rewards), **extra}
        n = float(chosen_lengths.shape[0])
        for key in self.logged_stats:
            stats[key.replace("/", "_")].update(values[key], weight=n)
        if stats is self.eval_stats and (self.eval_metric_objects or self.eval_metric_fns):
            preference = torch.sigmoid(chosen_rewards - rejected_rewards)  # Bradley-Terry P(chosen > rejected)
            self.update_eval_metrics(preference, torch.ones_like(preference, dtype=torch.long))
        return loss

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
