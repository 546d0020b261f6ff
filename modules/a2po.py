"""A*-PO, optimal advantage regression: ``A2POModule`` (TRL 1.16's ``A2POTrainer`` knobs and formulas) on the
online-RL loop.

Two stages. Before training (at fit start), the value-estimation stage (``estimate_rewards``, cached on disk and
kept in the checkpoints) samples ``num_value_samples`` reference completions per training prompt and estimates
each prompt's optimal value ``V*`` (``optimal_values``, temperature ``beta1``); with ``filter_all_incorrect`` the
prompts whose samples all scored 0 leave the training data. Then the loop of ``OnlineRLModule`` samples one
completion per prompt from the policy, scores it, and the loss (the pure function ``a2po_loss``) regresses
``beta2 * log(pi / pi_ref)`` onto ``r - V*``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightalign.knobs import takes_knobs
from lightalign.modules.agent.episodes import ToolKnobs
from lightalign.modules.losses.a2po import A2POLossConfig, a2po_loss
from lightalign.modules.reference.bema import BEMAKnobs
from lightalign.modules.reference.sync import ReferenceSyncKnobs
from lightalign.modules.rollout.critic_free import CriticFreeModule
from lightalign.modules.rollout.offpolicy.component import AsyncRolloutKnobs
from lightalign.modules.rollout.scoring import metric_key
from lightalign.modules.rollout.value_estimate import (OptimalValues, ValueEstimateKnobs, all_incorrect,
                                                       estimate_rewards, optimal_values)

__all__ = ["A2POModule", "a2po_loss"]


@takes_knobs(ValueEstimateKnobs, A2POLossConfig, without=(ToolKnobs, AsyncRolloutKnobs, ReferenceSyncKnobs, BEMAKnobs),
             defaults={"num_generations": 1})
class A2POModule(CriticFreeModule):
    """A*-PO on the prompt batches of ``PromptDataModule`` (TRL 1.16's knob names and defaults): ``V*`` per prompt
    from reference samples before training (``ValueEstimateKnobs``), then one policy completion per prompt regressed
    onto its optimal advantage (``A2POLossConfig``). The reward is taken as it is (TRL assumes it binary, 0 or 1);
    ``filter_all_incorrect`` drops the prompts whose reference samples all got exactly 0.

    Not taken (``without=``): ``ToolKnobs`` (the value estimate samples single-turn reference completions),
    ``AsyncRolloutKnobs`` (the regression is on the policy's own completions, with no importance-sampling correction),
    ``ReferenceSyncKnobs`` and ``BEMAKnobs`` (``V*`` is estimated once from the reference before training, as TRL's
    frozen reference; a reference that moves would leave the regression target ``r - V*`` stale). ``use_vllm`` is
    refused at construction (``VLLMKnobs`` stays: the shared sampling code reads it)."""

    method_name = "A2PO"
    uses_reference_model = True
    min_generations = 1
    group_needs = "one completion per prompt"
    method_stats = ("v_star", "implicit_reward", "advantage")
    _unregistered_attributes = CriticFreeModule._unregistered_attributes | {"optimal", "restored_optimal"}
    optimal: OptimalValues | None = None
    restored_optimal: OptimalValues | None = None  # the estimate a checkpoint holds, until the fit start uses it

    def check_knob_combinations(self) -> None:
        super().check_knob_combinations()
        knobs = self.knobs
        if knobs.rollout.num_generations != 1:
            raise ValueError(f"A2POModule samples one completion per prompt (its baseline is the prompt's V*, "
                             f"estimated before training), got num_generations={knobs.rollout.num_generations}; "
                             "set num_generations: 1 (the default).")
        if knobs.vllm.use_vllm:
            raise ValueError("A2PO regresses the policy's own completions (TRL's A2POTrainer samples with the policy "
                             "itself, with no importance-sampling correction); use_vllm is not available for A2PO.")

    @property
    def uses_reference(self) -> bool:
        return True

    def logprob_temperature(self) -> float:
        return 1.0  # TRL's A2POTrainer: log-probs of the model's own distribution, whatever the sampling temperature

    # ------------------------------------------------------------------------------------- the value stage
    def on_fit_start(self) -> None:
        super().on_fit_start()  # the reference on the device
        datamodule = self.trainer.datamodule
        dataset, restored = datamodule.train_dataset, self.restored_optimal
        self.restored_optimal = None
        if restored is None:
            self.optimal = self.estimate_optimal_values(datamodule)
        elif restored.values.shape[0] != len(dataset):
            raise ValueError(f"The checkpoint holds V* of {restored.values.shape[0]} training prompts and the "
                             f"training data has {len(dataset)}: resume with the data the run started with.")
        else:
            self.optimal = OptimalValues(dataset["prompt_input_ids"], restored.values, restored.all_incorrect)
            rank_zero_info(f"A2PO: V* of {len(dataset)} training prompts restored from the checkpoint.")
        if self.hparams.filter_all_incorrect and self.optimal.all_incorrect.any():
            kept = (~self.optimal.all_incorrect).nonzero().flatten().tolist()
            needed = self.rollout_shape[0] // self.hparams.num_generations * self.trainer.world_size
            if len(kept) < needed:
                raise ValueError(f"filter_all_incorrect dropped {len(dataset) - len(kept)} of {len(dataset)} training "
                                 f"prompts (every reference sample scored 0), leaving fewer than one rollout of every "
                                 f"rank needs ({needed}); set filter_all_incorrect: false, or check the reward "
                                 "functions.")
            datamodule.train_dataset = dataset.select(kept)
            rank_zero_info(f"A2PO: filter_all_incorrect dropped {len(dataset) - len(kept)} of {len(dataset)} "
                           "training prompts (every reference sample scored 0).")

    def estimate_optimal_values(self, datamodule: Any) -> OptimalValues:
        """``V*`` of every training prompt from ``num_value_samples`` reference samples each (``estimate_rewards``:
        cached, resumable, sharded over the ranks)."""
        hp = self.hparams
        dataset = datamodule.train_dataset
        prompts = self.rollout_shape[0] // hp.num_generations
        rewards, sampled, loaded, folder = estimate_rewards(self, dataset, datamodule.collate_fn(),
                                                            hp.num_value_samples, datamodule.seed, prompts,
                                                            hp.value_cache_dir)
        rank_zero_info(f"A2PO: V* of {len(dataset)} training prompts ({hp.num_value_samples} reference samples "
                       f"each): {sampled} estimated now, {loaded} loaded from the cache ({folder}).")
        return OptimalValues(dataset["prompt_input_ids"], optimal_values(rewards, hp.beta1), all_incorrect(rewards))

    # ------------------------------------------------------------------------------------- advantages
    def check_scores(self, per_func: torch.Tensor, total: torch.Tensor) -> None:
        if torch.isnan(total).any():
            raise ValueError("A2PO regresses onto r - V* for every completion, and no reward function scored one "
                             "(every function returned None); return a number for it, or set reward_fallback_value.")

    def rollout_advantages(self, chunks: list[dict[str, torch.Tensor]]) -> None:
        for mb in chunks:
            mb["v_star"] = self.optimal.lookup(mb["prompt_ids"], mb["prompt_mask"])
            mb["advantages"] = mb["rewards"] - mb["v_star"]
            self.train_stats[metric_key("v_star")].update(mb["v_star"].mean())

    # ------------------------------------------------------------------------------------- training
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        mb, _ = self.next_micro_batch(batch)
        with self.training_forward_context():
            logps, entropies = self.token_logps(self.model, mb, with_entropy=self.hparams.log_entropy)
        loss, stats = a2po_loss(logps, mb["ref_logps"], mb["completion_mask"], mb["rewards"], mb["v_star"],
                                config=self.knobs.a2po_loss)
        s = self.train_stats
        s[metric_key("loss")].update(loss.detach())
        s[metric_key("implicit_reward")].update(stats["implicit_reward"])
        s[metric_key("advantage")].update(stats["advantage"])
        mask = mb["completion_mask"].bool()
        if entropies is not None and mask.any():
            s[metric_key("entropy")].update(entropies.detach()[mask].mean())
        return self.add_router_aux_loss(loss)

    # ------------------------------------------------------------------------------------- state
    def method_state(self) -> dict[str, Any]:
        return {"a2po_optimal_values": self.optimal.state_dict()} if self.optimal is not None else {}

    def load_method_state(self, state: dict[str, Any]) -> None:
        if "a2po_optimal_values" in state:  # the estimate of the run's start: a resumed run does not redo it
            table = state["a2po_optimal_values"]
            self.restored_optimal = OptimalValues([], table["values"], table["all_incorrect"])
