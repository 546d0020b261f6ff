"""``TPOModule``: triple preference optimisation (TRL 1.16's experimental ``TPOTrainer``) on the triple batches of
``TriplePreferenceDataModule`` (the loss itself is the pure function ``tpo_loss``).

TPO is reference-free: no reference model is built and no reference forward runs. The "reference" of a triple is
its gold response, whose negative log-likelihood (weighted by ``tpo_alpha``) joins the chosen-versus-rejected
loss; its tokens go through the same forward as chosen and rejected.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics.aggregation import SumMetric

from lightalign.knobs import takes_knobs
from lightalign.modules.losses.tpo import TPO_LOSS_TYPES, TPOLossConfig, tpo_loss  # noqa: F401  (public names)
from lightalign.modules.training.logprobs import mean_entropy, selective_log_softmax, shared_prefix_logits
from lightalign.modules.training.policy import PolicyModule
from lightalign.modules.training.preference_forward import real_token_count, shared_prompt_layout
from lightalign.modules.training.stat_hooks import StatHooks

# TRL's metric names (logged as train/<name>, val/<name>); num_tokens is the running count of training tokens
TRIPLE_STATS = ("loss", "entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy", "rewards/chosen",
                "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")
CHOSEN, REJECTED, REFERENCE = 0, 1, 2  # the blocks of sequence ids (block k holds sequences k*B .. k*B + B - 1)


def completion_token_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    """One forward of a triple (or pair) batch, either layout -> ``(logits [K, V], targets [K], sequence [K])``: the
    logits predicting each of the batch's ``K`` completion tokens, the token, and its sequence id (classic layout:
    its row)."""
    if shared_prompt_layout(batch):
        return shared_prefix_logits(model, batch), batch["targets"], batch["target_sequence"]
    input_ids = batch["input_ids"]
    logits = model(input_ids=input_ids, attention_mask=batch["attention_mask"], use_cache=False).logits
    mask = batch["completion_mask"][:, 1:].bool()
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None].expand_as(mask)
    return logits[:, :-1][mask], input_ids[:, 1:][mask], rows[mask]


@takes_knobs(TPOLossConfig, defaults={"disable_dropout": True})
class TPOModule(StatHooks, PolicyModule):
    """Triple preference optimisation on ``TriplePreferenceDataModule``'s batches.

    Chosen, rejected and (with ``tpo_alpha`` > 0) the gold reference go through the policy in one forward (shared
    prompt or padded rows). Logged per optimizer step (``train/``) and per validation epoch (``val/``), TRL's
    names: ``loss``, ``entropy`` (mean over every completion token), ``logits/chosen``, ``logits/rejected`` (mean
    logit over the vocabulary and the completion tokens), ``mean_token_accuracy`` (chosen tokens the argmax
    predicts), ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins`` (``beta *
    logp``: no reference), ``logps/chosen``, ``logps/rejected`` (per token for ``ipo``/``tpo-l``) and
    ``num_tokens`` (training tokens so far, prompt counted once per completion, as TRL). ``eval_metrics``
    receive ``sigmoid(reward margin)`` and a target of ones.

    Its knobs: ``TPOLossConfig``'s and ``PolicyModule``'s; ``disable_dropout`` defaults to on, as in TRL.
    """

    method_name = "TPO"
    logged_stats = TRIPLE_STATS

    def compose(self) -> None:
        super().compose()
        self.build_stat_metrics()
        self.step_tokens = SumMetric()  # this optimizer step's tokens, summed over micro-batches and ranks
        self.register_buffer("total_train_tokens", torch.zeros((), dtype=torch.long), persistent=True)

    # ------------------------------------------------------------------------------------- data
    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None:
            self.use_datamodule(datamodule)

    def use_datamodule(self, datamodule: Any) -> None:
        """Refuse data without triples; tell the triple data whether its batches carry the reference rows (not
        with ``tpo_alpha = 0``: no forward on the gold response). Runs before any loader is built."""
        if not hasattr(datamodule, "include_reference"):
            raise ValueError(f"TPOModule trains on triples (prompt, chosen, rejected, reference): use "
                             f"TriplePreferenceDataModule, not {type(datamodule).__name__}.")
        wanted = self.knobs.loss.tpo_alpha != 0.0
        if datamodule.include_reference is not None and datamodule.include_reference != wanted:
            raise ValueError(f"TriplePreferenceDataModule's include_reference is {datamodule.include_reference}, but "
                             f"TPOModule's tpo_alpha {self.knobs.loss.tpo_alpha} "
                             f"{'needs' if wanted else 'reads no'} reference rows: leave include_reference unset "
                             "(TPOModule decides from tpo_alpha).")
        datamodule.include_reference = wanted

    def batch_layout(self) -> tuple[str, int | None]:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        layout = "dpo_shared" if getattr(datamodule, "prompt_sharing", False) else "dpo_classic"
        return layout, getattr(datamodule, "max_length", None)

    # ------------------------------------------------------------------------------------- loss
    def _step(self, batch: dict[str, torch.Tensor], stats: torch.nn.ModuleDict) -> torch.Tensor:
        triples = int(batch["chosen_lengths"].shape[0])
        blocks = 3 if "reference_lengths" in batch else 2
        logits, targets, sequence = completion_token_logits(self.model, batch)
        token_logps = selective_log_softmax(logits, targets)
        sums = token_logps.new_zeros(blocks * triples).index_add(0, sequence, token_logps)
        block = sequence // triples
        loss, out = tpo_loss(sums[:triples], sums[triples: 2 * triples], batch["chosen_lengths"],
                             batch["rejected_lengths"], token_logps[block == REFERENCE] if blocks == 3 else None,
                             self.knobs.loss)
        with torch.no_grad():
            chosen = block == CHOSEN
            chosen_logits = logits.detach()[chosen].float()
            tokens = int(chosen.sum())
            rewards_chosen, rewards_rejected = out["rewards_chosen"], out["rewards_rejected"]
            values = {
                "loss": loss.detach(),
                "entropy": mean_entropy(logits, torch.ones_like(block, dtype=torch.bool)),
                "logits/chosen": chosen_logits.mean(),
                "logits/rejected": logits.detach()[block == REJECTED].float().mean(),
                "mean_token_accuracy": (chosen_logits.argmax(-1) == targets[chosen]).float().mean(),
                "rewards/chosen": rewards_chosen.mean(),
                "rewards/rejected": rewards_rejected.mean(),
                "rewards/accuracies": (rewards_chosen > rewards_rejected).float().mean(),
                "rewards/margins": (rewards_chosen - rewards_rejected).mean(),
                "logps/chosen": out["chosen_logps"].mean(),
                "logps/rejected": out["rejected_logps"].mean(),
            }
            weights = {"entropy": block.numel(), "logits/chosen": tokens, "mean_token_accuracy": tokens,
                       "logits/rejected": int((block == REJECTED).sum())}
            for key, value in values.items():
                stats[key.replace("/", "_")].update(value, weight=float(weights.get(key, triples)))
            if stats is self.train_stats:
                self.step_tokens.update(self._sequence_tokens(batch, blocks, block.numel()))
            if stats is self.eval_stats and (self.eval_metric_objects or self.eval_metric_fns):
                preference = torch.sigmoid(rewards_chosen - rewards_rejected)  # Bradley-Terry P(chosen > rejected)
                self.update_eval_metrics(preference, torch.ones_like(preference, dtype=torch.long))
        return loss

    @staticmethod
    def _sequence_tokens(batch: dict[str, torch.Tensor], blocks: int, completion_tokens: int) -> float:
        """Tokens of the batch's sequences with the prompt counted once per completion (TRL's ``num_tokens``,
        whichever layout computed them)."""
        if shared_prompt_layout(batch):
            return float(blocks * int((batch["branch"] == 0).sum()) + completion_tokens)
        return float(batch["attention_mask"].sum())

    def _log_stats(self, stats: torch.nn.ModuleDict, stage: str) -> None:
        super()._log_stats(stats, stage)
        if stage == "train":
            self.total_train_tokens += int(self.step_tokens.compute())
            self.step_tokens.reset()
        self.log(f"{stage}/num_tokens", self.total_train_tokens.float())

    # ------------------------------------------------------------------------------------- hooks
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.last_batch_tokens, self.last_batch_samples = real_token_count(batch), int(batch["chosen_lengths"].shape[0])
        with self.training_forward_context():
            loss = self._step(batch, self.train_stats)
        return self.add_router_aux_loss(loss)
