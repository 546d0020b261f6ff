"""Proximal policy optimisation with a value head: ``PPOModule``. TRL 1.16.0 ships no PPO: the formulas and knobs
are those of TRL <= 0.11's ``trl.PPOTrainer`` (v0.11.4: rewards, GAE, whitening, clipped losses,
``adap_kl_ctrl``, the score knobs) and of its successor, ``trl.experimental.ppo.PPOTrainer`` in TRL 0.26-1.9
(``kl_coef``, ``num_ppo_epochs``, ``num_mini_batches``, ``missing_eos_penalty``, ``stop_token``); docs/ppo.md lists
the sources.

PPO runs on the online-RL loop (``OnlineRLModule``), as GRPO and RLOO do:
``PromptDataModule`` prompts, the sampler, the reward functions (or reward-model folders), the rollout buffer reused
across ``training_step`` calls, exact resume and the strategies. Its advantage stage (``rollout_advantages``): score (``missing_eos_penalty``, ``use_score_scaling``/``use_score_norm``,
``score_clip``), one no-grad forward for the sampling policy's log-probs and values, the reference's log-probs,
per-token rewards (``-kl_coef * (logp - ref_logp)`` on every token, the score on the last), GAE and whitened
advantages (``token_rewards``, ``gae``, ``whiten``). Then ``num_ppo_epochs`` passes over the rollout's ``num_mini_batches``
mini-batches (one optimizer step each; with ``accumulate_grad_batches`` = k a mini-batch is k micro-batches, i.e.
``training_step`` calls), each with the clipped policy loss plus ``vf_coef`` times the clipped value loss, both
averaged over the mini-batch's completion tokens. Rollouts sampled by vLLM (``use_vllm``) keep the sampler's
log-probs; the importance-sampling ratio of the rollout-time ``old_logps`` over them (``vllm_importance_sampling_*``,
the shared ``OffPolicyRollouts`` component) weights the clipped policy term of each token, never the value loss nor
the KL penalty in the rewards (verl's truncated importance sampling for PPO; TRL has no PPO).

The value head (``ValueHead``) is a linear map of the policy's last hidden state from the same forward
as the log-probs; it is trained with the policy (its gradient also reaches the shared trunk, as with TRL's
``AutoModelForCausalLMWithValueHead``), checkpointed, and saved beside the export (``value_head.safetensors``).

Logged names: TRL's ``objective/kl``, ``objective/entropy``, ``objective/scores``, ``objective/non_score_reward``,
``policy/approxkl``, ``policy/clipfrac``, ``val/clipfrac``, ``val/value_loss``, ``val/explained_variance``, under
the stage prefix of every lightalign module: ``train/objective/kl`` ... and ``train/val/value_loss``. In TRL ``val/``
means the value function; here a top-level ``val/`` is the validation stage (``val/reward/mean``), so the value
function's statistics are always ``train/val/...`` and never clash with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightalign.knobs import KnobGroup, knob, takes_knobs
from lightalign.modules.sampling.completions import eos_token_ids
from lightalign.modules.losses.entropy import token_entropies
from lightalign.modules.losses.advantages import MissingEOSKnobs, gae, masked_mean, token_rewards, whiten
from lightalign.modules.losses.advantages.gae import GAEKnobs
from lightalign.modules.losses.ppo import (KLControllerKnobs, PPOLossKnobs, ScoreKnobs, ScoreProcessor,
                                         clipped_policy_loss, clipped_value_loss, explained_variance)
from lightalign.modules.reference.component import SharedLayersKnobs
from lightalign.modules.rollout.buffer import RolloutBuffer, in_rollout_order, reshuffle_rollout, scatter_rows
from lightalign.modules.rollout.module import OnlineRLModule
from lightalign.modules.rollout.scoring import metric_key
from lightalign.modules.training.value_head import (ValueHead, ValueModelKnobs, find_hidden_size,
                                                    hidden_size_from_folder, policy_forward, unknown_architecture)

__all__ = ["PPOModule"]

_PPO_STATS = ("objective/kl", "objective/entropy", "objective/scores", "objective/non_score_reward",
              "objective/kl_coef", "policy/approxkl", "policy/clipfrac", "policy/entropy", "loss/policy",
              "val/value_loss", "val/clipfrac", "val/explained_variance")


@dataclasses.dataclass(frozen=True)
class PPOScheduleKnobs(KnobGroup):
    """How PPO trains on a rollout: passes over it, each dealt into mini-batches of one optimizer step."""

    group = "ppo_schedule"
    num_mini_batches: int = knob(
        1, "optimizer steps per pass over a rollout; each takes ``generation_batch_size / num_mini_batches`` "
           "completions (split into ``accumulate_grad_batches`` micro-batches).")
    num_ppo_epochs: int = knob(
        4, "passes over each rollout (TRL 0.12-1.9's name; TRL <= 0.11's ``ppo_epochs``). Each pass deals the "
           "rollout's completions into mini-batches anew (a permutation drawn from the torch RNG, as TRL does); the "
           "order in progress and the RNG are in the checkpoint.")

    def check(self) -> None:
        if not self.num_ppo_epochs >= 1:
            raise ValueError(f"num_ppo_epochs must be >= 1 (passes over each rollout), got {self.num_ppo_epochs}.")
        if not self.num_mini_batches >= 1:
            raise ValueError(f"num_mini_batches must be >= 1, got {self.num_mini_batches}.")


@dataclasses.dataclass(frozen=True)
class StopTokenKnobs(KnobGroup):
    """Where PPO's generation stops (TRL 0.12-1.9's ``stop_token``)."""

    group = "stop"
    stop_token: str | None = knob(
        "eos", "``eos`` (generation stops at the model's / tokenizer's EOS, the only stop the sampling knows; TRL's "
               "default None, which generates to the length limit, is not supported).")

    def check(self) -> None:
        if self.stop_token != "eos":
            raise ValueError(f"stop_token={self.stop_token!r} is not supported: generation stops at the EOS token "
                             "(stop_token: eos); TRL's None (generate to max_completion_length) is not available.")


@takes_knobs(PPOScheduleKnobs, PPOLossKnobs, GAEKnobs, KLControllerKnobs, ScoreKnobs, MissingEOSKnobs, StopTokenKnobs,
             ValueModelKnobs, SharedLayersKnobs, defaults={"num_generations": 1, "temperature": 0.7})
class PPOModule(OnlineRLModule):
    """PPO with a value head on the prompt batches of ``PromptDataModule`` (TRL's PPO knob names).

    One completion per prompt by default (``num_generations`` 1: the baseline is the value function), sampled at TRL
    0.12-1.9's PPO temperature 0.7; the reference model is built when ``kl_coef > 0``. A reward function's score must
    be finite for every completion (None/NaN or an infinite score is an error naming the function). Its knobs: the
    schedule (``PPOScheduleKnobs``), the clipped losses (``PPOLossKnobs``), GAE (``GAEKnobs``), the KL controller
    (``KLControllerKnobs``), the scores (``ScoreKnobs``, ``MissingEOSKnobs``), the stop (``StopTokenKnobs``), the value
    network (``ValueModelKnobs``) and the reference's shared layers (``SharedLayersKnobs``), on the online-RL loop.
    """

    method_name = "PPO"
    uses_reference_model = True
    min_generations = 1  # the baseline is the value function
    knob_equivalents = {"num_iterations": "num_ppo_epochs", "epsilon": "cliprange", "beta": "kl_coef",
                        "steps_per_generation": "num_mini_batches"}
    method_stats = _PPO_STATS

    def check_knob_combinations(self) -> None:
        super().check_knob_combinations()
        knobs = self.knobs
        shared = knobs.shared_layers.num_shared_layers
        if shared is not None and not knobs.kl_control.kl_coef > 0:
            raise ValueError("num_shared_layers shapes the reference model, and kl_coef 0 uses none: set kl_coef > 0 "
                             "or drop num_shared_layers.")
        if shared is not None and (knobs.reference.ref_model_name_or_path or knobs.reference.ref_model_init_kwargs):
            raise ValueError("num_shared_layers shares the policy's own layers; it cannot be combined with a "
                             "separately loaded reference (ref_model_name_or_path / ref_model_init_kwargs).")
        if shared is not None and knobs.model.peft_config is not None:
            raise ValueError("num_shared_layers does not apply to a LoRA policy: its reference is the base model with "
                             "the adapters disabled (no copy at all); drop num_shared_layers.")
        batch, mini_batches = knobs.rollout.generation_batch_size, knobs.ppo_schedule.num_mini_batches
        if batch is not None and batch % mini_batches:
            raise ValueError(f"generation_batch_size ({batch}) must split evenly into num_mini_batches "
                             f"({mini_batches}) mini-batches.")

    def compose(self) -> None:
        super().compose()
        knobs = self.knobs
        score = knobs.score
        self.kl_ctl = knobs.kl_control.controller()
        self.score_processor = ScoreProcessor(knobs.missing_eos.missing_eos_penalty, score.use_score_scaling,
                                              score.use_score_norm, score.score_clip)
        hidden = self.value_head_width()
        self.value_head = None if hidden is None else ValueHead(hidden)
        self.value_model: torch.nn.Module | None = None

    def value_head_width(self) -> int | None:
        """The value head's input width, from the given model or the config of a local folder (the value network's
        when there is one); None for a hub name (found at ``configure_model``)."""
        model, name = self.knobs.model.model, self.knobs.model.model_name_or_path
        value_model = self.knobs.value_model.value_model_name_or_path
        hidden = None
        if model is not None:
            hidden = find_hidden_size(getattr(model, "config", None), model)
            if hidden is None:
                raise unknown_architecture(type(model).__name__, getattr(getattr(model, "config", None),
                                                                          "architectures", None))
        elif name is not None:
            hidden = hidden_size_from_folder(name)
        if value_model is not None:
            hidden = hidden_size_from_folder(value_model)
        return hidden

    def shared_layers(self) -> int | None:
        return self.knobs.shared_layers.num_shared_layers

    @property
    def uses_reference(self) -> bool:
        return self.hparams.kl_coef > 0

    def micro_batches_per_rollout(self) -> int:
        """``num_mini_batches`` x ``accumulate_grad_batches`` (a mini-batch is one optimizer step)."""
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        return self.hparams.num_mini_batches * accumulate

    def passes(self) -> int:
        return self.hparams.num_ppo_epochs

    def needs_old_logps(self) -> bool:
        return False  # the advantage stage computes them, with the values, in one forward

    # ------------------------------------------------------------------------------------- setup
    def configure_model(self) -> None:
        super().configure_model()
        hp = self.hparams
        if hp.value_model_name_or_path is not None and self.value_model is None:
            from lightalign.hub import load_causal_lm

            with torch.inference_mode(False):
                self.value_model = load_causal_lm(hp.value_model_name_or_path, from_config=hp.from_config,
                                                  init_kwargs=hp.value_model_init_kwargs,
                                                  trust_remote_code=hp.trust_remote_code)
            self.value_model.to(next(self.model.parameters()).device)
            self.value_model.requires_grad_(hp.vf_coef > 0)
        backbone = self.value_model if self.value_model is not None else self.model
        name = hp.value_model_name_or_path or self.model_name_or_path
        if self.value_head is None:
            hidden = find_hidden_size(getattr(backbone, "config", None), backbone)
            if hidden is None:
                raise unknown_architecture(str(name), getattr(getattr(backbone, "config", None), "architectures", None))
            self.value_head = ValueHead(hidden)
        if backbone.get_output_embeddings() is None:
            raise ValueError(f"PPOModule's value head reads the input of the output embedding, and model "
                             f"'{name}' has none: use a causal LM (…ForCausalLM).")
        self.value_head.to(next(self.model.parameters()).device)
        self.value_head.requires_grad_(self.hparams.vf_coef > 0)  # vf_coef 0: frozen (DDP then skips it too)

    def sharded_submodules(self) -> list[torch.nn.Module]:
        """The trained modules beside ``model`` a sharding strategy must shard too (FSDP2Strategy)."""
        return [m for m in (self.value_model, self.value_head) if m is not None]

    def create_optimizer(self) -> torch.optim.Optimizer:
        """The policy's optimizer (``PolicyModule.create_optimizer``) with the value head as one more parameter group
        (the default AdamW: weight decay on its weight, not its bias; factories and presets: their defaults)."""
        optimizer = super().create_optimizer()
        head = self.value_head.summary
        if not head.weight.requires_grad:  # vf_coef 0
            return optimizer
        if self.value_model is not None:
            optimizer.add_param_group({"params": [p for p in self.value_model.parameters() if p.requires_grad]})
        if self.knobs.optimization.optimizer is None and self.knobs.optimization.optim is None:
            optimizer.add_param_group({"params": [head.weight], "weight_decay": self.hparams.weight_decay})
            optimizer.add_param_group({"params": [head.bias], "weight_decay": 0.0})
        else:
            optimizer.add_param_group({"params": list(head.parameters())})
        return optimizer

    # ------------------------------------------------------------------------------------- rollout
    def check_scores(self, per_func: torch.Tensor, total: torch.Tensor) -> None:
        """A completion without a score is an error (the runner already refuses an infinite reward, naming the
        function)."""
        missing = torch.isnan(total).nonzero()
        if len(missing):
            i = int(missing[0, 0])
            names = [n for j, n in enumerate(self.reward_names) if torch.isnan(per_func[i, j])]
            raise ValueError(f"No score for completion {i} of the rollout: reward function(s) {names} returned None "
                             "or NaN for it. PPO needs a finite score for every completion (GRPO's 'not applicable' "
                             "None has no meaning here): return a number.")

    @torch.no_grad()
    def rollout_advantages(self, chunks: list[dict[str, torch.Tensor]]) -> None:
        """The sampling policy's log-probs and values, scores -> per-token rewards (KL penalty) -> GAE -> whitened
        advantages and returns."""
        hp = self.hparams
        for mb in chunks:
            mb["old_logps"], _, mb["old_values"] = policy_forward(self.model, self.value_head, mb, hp.temperature,
                                                                  self.value_model)
        mask, logps, values, completion_ids, scores = in_rollout_order(
            chunks, "completion_mask", "old_logps", "old_values", "completion_ids", "rewards")
        values = values.float() * mask
        eos = torch.tensor(eos_token_ids(self.model, self.tokenizer), device=mask.device)
        has_eos = (torch.isin(completion_ids, eos) & mask.bool()).any(-1)
        scores = self.score_processor.penalize(scores.float(), has_eos)
        s = self.train_stats
        s[metric_key("objective/scores")].update(scores.mean())
        world = self.trainer.world_size if self._trainer is not None else 1
        gather = (lambda x: self.all_gather(x).flatten()) if world > 1 else (lambda x: x)  # noqa: E731
        scores = self.score_processor.scale(scores, pool=gather(scores) if world > 1 else None)
        ref = in_rollout_order(chunks, "ref_logps")[0] if self.uses_reference else None
        coef = self.kl_ctl.value
        rewards, kl = token_rewards(scores, logps.float(), None if ref is None else ref.float(), mask, coef)
        # under DDP the whitening statistics are every rank's tokens' (what one process with the whole batch computes)
        summed = (lambda t: self.trainer.strategy.reduce(t, reduce_op="sum")) if world > 1 else None  # noqa: E731
        if hp.whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False, sum_over_ranks=summed) * mask
        advantages, returns = gae(rewards, values, mask, hp.gamma, hp.lam)
        advantages = whiten(advantages, mask, sum_over_ranks=summed) * mask
        seq_kl = kl.sum(-1)
        s[metric_key("objective/kl")].update(seq_kl.mean())
        s[metric_key("objective/entropy")].update((-logps * mask).sum(-1).mean())
        s[metric_key("objective/non_score_reward")].update((-coef * seq_kl).mean())
        s[metric_key("objective/kl_coef")].update(torch.tensor(coef, device=mask.device))
        all_kl = gather(seq_kl)
        self.kl_ctl.update(float(all_kl.mean()), int(all_kl.numel()))
        scatter_rows(chunks, advantages=advantages, returns=returns, old_values=values)

    def on_new_pass(self, buffer: RolloutBuffer) -> None:
        """At the start of every pass over a rollout but the first, the rollout's rows are dealt into new
        mini-batches (``reshuffle_rollout``). A rollout of one micro-batch is not dealt: every pass trains on all of
        it anyway (and the RNG stream stays the one-pass runs')."""
        if self.micro_batches_per_rollout() > 1:
            buffer.chunks = reshuffle_rollout([move_data_to_device(mb, self.device) for mb in buffer.chunks])

    # ------------------------------------------------------------------------------------- training
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        mb, slot = self.next_micro_batch(batch)
        with self.training_forward_context():
            logps, logits, values = policy_forward(self.model, self.value_head, mb, hp.temperature, self.value_model)
        mask = mb["completion_mask"]
        accumulate = self.trainer.accumulate_grad_batches
        step_tokens = self.step_tokens(slot).float().clamp(min=1)  # the optimizer step's tokens normalise the loss
        # on-policy (one pass, one mini-batch) the ratio is 1 by definition: a second forward's rounding (or dropout)
        # must not clip anything
        old = mb["old_logps"] if self.reuses_rollout() else logps.detach()
        # rollouts sampled by vLLM: the policy's rollout-time log-probs (old_logps) over the sampler's, weighting the
        # clipped policy term only (None when the policy sampled them, or the correction is off)
        is_ratio = self.off_policy.importance_ratio(self, mb, logps)
        pg_loss, pg_stats = clipped_policy_loss(logps, old, mb["advantages"], mask, hp.cliprange, step_tokens,
                                                importance_sampling_ratio=is_ratio)
        vf_loss, vf_stats = clipped_value_loss(values, mb["old_values"], mb["returns"], mask, hp.cliprange_value,
                                               step_tokens)
        loss = pg_loss + hp.vf_coef * vf_loss if hp.vf_coef > 0 else pg_loss
        s = self.train_stats
        s[metric_key("loss")].update(loss.detach() * accumulate)
        s[metric_key("loss/policy")].update(pg_loss.detach() * accumulate)
        s[metric_key("val/value_loss")].update(vf_loss.detach() * accumulate)
        s[metric_key("policy/approxkl")].update(pg_stats["approxkl"])
        s[metric_key("policy/clipfrac")].update(pg_stats["clipfrac"])
        s[metric_key("val/clipfrac")].update(vf_stats["clipfrac"])
        s[metric_key("val/explained_variance")].update(explained_variance(values.detach(), mb["returns"], mask))
        if hp.log_entropy and mask.any():
            with torch.no_grad():
                s[metric_key("policy/entropy")].update(masked_mean(token_entropies(logits), mask))
        return self.add_router_aux_loss(loss * accumulate)

    # ------------------------------------------------------------------------------------- state and export
    def method_state(self) -> dict[str, Any]:
        """The KL controller and the score statistics (the same on every rank: both are updated from every rank's
        rollout)."""
        return {"kl_ctl": self.kl_ctl.state_dict(), "score_moments": self.score_processor.state_dict()}

    def load_method_state(self, state: dict[str, Any]) -> None:
        if "kl_ctl" in state:
            self.kl_ctl.load_state_dict(state["kl_ctl"])
        if "score_moments" in state:
            self.score_processor.load_state_dict(state["score_moments"])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.load_method_state(checkpoint.get("lightalign_ppo", {}))  # the older checkpoint key (docs/changelog.md)

    def gather_export_extras(self) -> dict[str, Any]:
        """On every rank (the gathers are collectives under FSDP2 / ZeRO-3): the value head's whole tensors and the
        value model's full weights (None when it is not sharded)."""
        from lightalign.strategies.sharding import full_state_dict

        extras: dict[str, Any] = {"value_head": self.value_head.whole_tensors()}
        if self.value_model is not None:
            root = self.trainer.strategy.model if self._trainer is not None else None
            extras["value_model"] = full_state_dict(self.value_model, root=root)
        return extras

    def export_hf(self, output_dir: Any, tokenizer: Any = None, merge_lora: bool = False,
                  state_dict: dict[str, torch.Tensor] | None = None, extras: dict[str, Any] | None = None):
        """The policy as an ordinary causal-LM folder, with ``value_head.safetensors`` and ``value_head.json`` beside
        its weights (read back by ``load_value_head``). ``extras``: ``gather_export_extras()``'s,
        required when the module is sharded."""
        self.configure_model()
        extras = extras if extras is not None else self.gather_export_extras()
        path = super().export_hf(output_dir, tokenizer=tokenizer, merge_lora=merge_lora, state_dict=state_dict)
        self.value_head.save(path, extras["value_head"])
        if self.value_model is not None:
            self.value_model.save_pretrained(path / "value_model", safe_serialization=True,
                                             state_dict=extras.get("value_model"))
        return path
