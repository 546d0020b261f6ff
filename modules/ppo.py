"""Proximal policy optimisation with a value head: ``PPOModule`` (the knobs and formulas of TRL's ``PPOTrainer``,
``trl.experimental.ppo``, and of its older version: ``adap_kl_ctrl``, the score knobs).

PPO runs on GRPO's machinery, as RLOO does: ``PromptDataModule`` prompts, generation, the reward functions (or
reward-model folders), the rollout buffer reused across ``training_step`` calls, exact resume and the strategies.
Per rollout (``_make_rollout``): sample, score (``missing_eos_penalty``, ``use_score_scaling``/``use_score_norm``,
``score_clip``), one no-grad forward for the sampling policy's log-probs and values, the reference's log-probs,
per-token rewards (``-kl_coef * (logp - ref_logp)`` on every token, the score on the last), GAE and whitened
advantages (``modules/losses/ppo.py``). Then ``num_ppo_epochs`` passes over the rollout's ``num_mini_batches``
mini-batches (one optimizer step each; with ``accumulate_grad_batches`` = k a mini-batch is k micro-batches, i.e.
``training_step`` calls), each with the clipped policy loss plus ``vf_coef`` times the clipped value loss, both
averaged over the mini-batch's completion tokens.

The value head (``modules/training/value_head.py``) is a linear map of the policy's last hidden state from the same forward
as the log-probs; it is trained with the policy (its gradient also reaches the shared trunk, as with TRL's
``AutoModelForCausalLMWithValueHead``), checkpointed, and saved beside the export (``value_head.safetensors``).

Logged names: TRL's ``objective/kl``, ``objective/entropy``, ``objective/scores``, ``objective/non_score_reward``,
``policy/approxkl``, ``policy/clipfrac``, ``val/clipfrac``, ``val/value_loss``, ``val/explained_variance``, under
the stage prefix of every lightalign module: ``train/objective/kl`` ... and ``train/val/value_loss``. In TRL ``val/``
means the value function; here a top-level ``val/`` is the validation stage (``val/reward/mean``), so the value
function's statistics are always ``train/val/...`` and never clash with it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torchmetrics.aggregation import MeanMetric

from lightalign.modules.losses.entropy import token_entropies
from lightalign.modules.generation.sampling import check_generation_arithmetic, eos_token_ids
from lightalign.modules.grpo import GRPOModule
from lightalign.modules.rollout.grpo_rollout import _key
from lightalign.modules.losses.ppo import (AdaptiveKLController, FixedKLController, ScoreProcessor, clipped_policy_loss,
                                         clipped_value_loss, explained_variance, gae, masked_mean, token_rewards, whiten)
from lightalign.modules.training.value_head import (ValueHead, find_hidden_size, hidden_size_from_folder, policy_forward,
                                           unknown_architecture)

__all__ = ["PPOModule"]

# GRPO knobs PPO sets itself or has no use for (its advantage is GAE on a value function, its loss PPO's clipped pair)
_GRPO_ONLY = ("loss_type", "delta", "importance_sampling_level", "sapo_temperature_pos", "sapo_temperature_neg",
              "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "off_policy_mask_threshold",
              "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max",
              "entropy_coef_delta", "entropy_target", "use_bias_correction_kl", "scale_rewards", "normalize_rewards",
              "reward_clip", "multi_objective_aggregation", "beta", "epsilon", "epsilon_high", "steps_per_generation",
              "num_iterations", "prompt_sharing", "pack_length")
_PPO_STATS = ["objective/kl", "objective/entropy", "objective/scores", "objective/non_score_reward",
              "objective/kl_coef", "policy/approxkl", "policy/clipfrac", "policy/entropy", "loss/policy",
              "val/value_loss", "val/clipfrac", "val/explained_variance"]


def check_ppo_rollout(num_generations: int, num_iterations: int, steps_per_generation: int | None,
                      generation_batch_size: int | None, pack_length: int) -> None:
    """PPO's rollout knobs: one completion per prompt is allowed (the baseline is the value function)."""
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1 (completions per prompt), got {num_generations}.")
    if num_iterations < 1:
        raise ValueError(f"num_ppo_epochs must be >= 1 (passes over each rollout), got {num_iterations}.")
    if generation_batch_size is not None:
        check_generation_arithmetic(generation_batch_size, num_generations, None)


def reshuffle_rollout(chunks: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The rollout's rows (every per-row tensor of its micro-batches) dealt into as many micro-batches of the same
    size, in a new random order (``torch.randperm`` on the rows' device)."""
    full = {}
    for key in chunks[0]:
        parts = [mb[key] for mb in chunks]
        if not all(isinstance(t, torch.Tensor) and t.shape[0] == mb["row"].shape[0] for t, mb in zip(parts, chunks)):
            raise TypeError(f"PPO's rollout entry {key!r} is not one row per completion: it cannot be reshuffled.")
        full[key] = torch.cat(parts)
    order = torch.randperm(full["row"].shape[0], device=full["row"].device)
    size = chunks[0]["row"].shape[0]
    return [{k: v[order[i * size:(i + 1) * size]] for k, v in full.items()} for i in range(len(chunks))]


class PPOModule(GRPOModule):
    """PPO with a value head on the prompt batches of ``PromptDataModule`` (TRL's PPO knob names).

    Args:
        reward_funcs, reward_weights: as ``GRPOModule``: callables ``fn(prompts, completions, **columns)``, import
            paths or reward-model folders (``RewardModule`` exports); the score is their weighted sum. A completion
            no function scores (None/NaN) or an infinite score is an error naming the function.
        num_generations: completions per prompt (TRL's PPO: 1).
        generation_batch_size: completions per rollout per device (TRL's ``local_batch_size``); default
            ``num_generations x num_mini_batches x accumulate_grad_batches`` (micro-batches of one completion).
        num_generations_eval, max_completion_length, temperature, top_p, top_k, min_p, repetition_penalty,
            generation_kwargs, cache_implementation, mask_truncated_completions, share_prefill: as ``GRPOModule``.
        num_mini_batches: optimizer steps per pass over a rollout; each takes ``generation_batch_size /
            num_mini_batches`` completions (split into ``accumulate_grad_batches`` micro-batches).
        num_ppo_epochs: passes over each rollout (TRL 1.16's name; old TRL's ``ppo_epochs``). Each pass deals the
            rollout's completions into mini-batches anew (a permutation drawn from the torch RNG, as TRL does); the
            order in progress and the RNG are in the checkpoint.
        kl_coef: coefficient of the per-token KL penalty ``logp - ref_logp`` in the reward (TRL's latest name; old
            TRL's ``init_kl_coef``); the start value of the adaptive controller. 0: no reference model.
        adap_kl_ctrl, target, horizon: the adaptive KL controller (``AdaptiveKLController``); off by default, as
            in TRL 1.16's PPO (old TRL had it on with ``init_kl_coef`` 0.2). Its state is checkpointed.
        gamma, lam: GAE's discount and lambda.
        whiten_rewards: whiten the per-token rewards (scale only) before GAE.
        cliprange: the policy ratio's clipping range ``[1 - cliprange, 1 + cliprange]``.
        cliprange_value: the values' clipping range around the rollout's values.
        vf_coef: weight of the value loss; 0 trains the value head not at all.
        use_score_scaling, use_score_norm, score_clip: divide scores by their running std (``use_score_norm``: also
            subtract the running mean; needs ``use_score_scaling``), clamp to ``[-score_clip, score_clip]``.
        missing_eos_penalty: subtracted from the score of a completion without EOS (cut at
            ``max_completion_length``).
        stop_token: ``eos`` (generation stops at the model's / tokenizer's EOS, the only stop GRPO's generation
            knows; TRL's default None, which generates to the length limit, is not supported).
        value_model_name_or_path, value_model_init_kwargs: a separate value network (a causal LM, loaded like the
            policy, ``from_config`` included) whose last hidden state feeds the value head, as newer PPO
            implementations use; trained by the value loss alone, checkpointed, exported to ``hf_model/value_model``.
            Default: the head sits on the policy's own hidden state.
        ref_model_name_or_path, ref_model_init_kwargs, log_entropy: as ``GRPOModule`` (the reference is built when
            ``kl_coef > 0``: a frozen copy, a separate (e.g. 8/4-bit) model, or the base model with LoRA disabled).
        num_shared_layers: the reference shares the policy's first k decoder layers (and everything before them),
            frozen in both, as TRL's ``create_reference_model``; the rest is a frozen copy.
        **kwargs: ``PolicyModule`` arguments (model, LoRA, optimizer, schedule). GRPO's own knobs (``beta``,
            ``epsilon``, ``num_iterations``, ``steps_per_generation``, ``loss_type`` ...) are refused when set to
            anything but their default; use the PPO names above.
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        reward_funcs: list[str | Callable] | str | Callable | None = None,
        reward_weights: list[float] | None = None,
        num_generations: int = 1,
        num_generations_eval: int | None = None,
        generation_batch_size: int | None = None,
        num_mini_batches: int = 1,
        num_ppo_epochs: int = 4,
        max_completion_length: int = 256,
        temperature: float = 0.7,
        top_p: float = 1.0,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        generation_kwargs: dict[str, Any] | None = None,
        cache_implementation: str | None = None,
        kl_coef: float = 0.05,
        adap_kl_ctrl: bool = False,
        target: float = 6.0,
        horizon: float = 10000.0,
        gamma: float = 1.0,
        lam: float = 0.95,
        whiten_rewards: bool = False,
        cliprange: float = 0.2,
        cliprange_value: float = 0.2,
        vf_coef: float = 0.1,
        use_score_scaling: bool = False,
        use_score_norm: bool = False,
        score_clip: float | None = None,
        missing_eos_penalty: float | None = None,
        stop_token: str | None = "eos",
        value_model_name_or_path: str | None = None,
        value_model_init_kwargs: dict[str, Any] | None = None,
        mask_truncated_completions: bool = False,
        ref_model_name_or_path: str | None = None,
        ref_model_init_kwargs: dict[str, Any] | None = None,
        num_shared_layers: int | None = None,
        log_entropy: bool = True,
        share_prefill: bool = True,
        **kwargs: Any,
    ) -> None:
        defaults = {n: p.default for n, p in inspect.signature(GRPOModule.__init__).parameters.items()}
        if kwargs.get("padding_free"):
            raise ValueError("padding_free is not supported by PPOModule (its GAE and value targets are computed on "
                             "the rollout's padded rows); use padding_free: false (the padded layout).")
        kwargs.pop("padding_free", None)
        given = sorted(k for k in set(kwargs) & set(_GRPO_ONLY) if kwargs[k] != defaults[k])
        for name in _GRPO_ONLY:
            kwargs.pop(name, None)
        if given:
            raise ValueError(f"{given} are GRPOModule knobs with no meaning in PPOModule (its advantage is GAE on a "
                             "value head, its loss the clipped policy and value losses; KL: kl_coef, clipping: "
                             "cliprange, passes: num_ppo_epochs, mini-batches: num_mini_batches); remove them.")
        checks = [(kl_coef >= 0, f"kl_coef must be >= 0 (the KL penalty's coefficient; 0: none), got {kl_coef}."),
                  (num_ppo_epochs >= 1, f"num_ppo_epochs must be >= 1 (passes over each rollout), got {num_ppo_epochs}."),
                  (num_mini_batches >= 1, f"num_mini_batches must be >= 1, got {num_mini_batches}."),
                  (0 <= gamma <= 1, f"gamma must be in [0, 1] (GAE's discount), got {gamma}."),
                  (0 <= lam <= 1, f"lam must be in [0, 1] (GAE's lambda), got {lam}."),
                  (cliprange > 0, f"cliprange must be > 0, got {cliprange}."),
                  (cliprange_value > 0, f"cliprange_value must be > 0, got {cliprange_value}."),
                  (vf_coef >= 0, f"vf_coef must be >= 0 (the value loss's weight), got {vf_coef}."),
                  (not adap_kl_ctrl or (target > 0 and horizon > 0),
                   f"adap_kl_ctrl needs target > 0 and horizon > 0, got target={target}, horizon={horizon}."),
                  (score_clip is None or score_clip > 0, f"score_clip must be > 0 or null, got {score_clip}."),
                  (not use_score_norm or use_score_scaling,
                   "use_score_norm normalises with the running statistics of use_score_scaling: set use_score_scaling "
                   "true too (as in TRL, where use_score_norm alone does nothing)."),
                  (stop_token == "eos", f"stop_token={stop_token!r} is not supported: generation stops at the EOS "
                   "token (stop_token: eos); TRL's None (generate to max_completion_length) is not available."),
                  (num_shared_layers is None or num_shared_layers >= 1,
                   f"num_shared_layers must be >= 1 or null, got {num_shared_layers}."),
                  (num_shared_layers is None or kl_coef > 0,
                   "num_shared_layers shapes the reference model, and kl_coef 0 uses none: set kl_coef > 0 or drop "
                   "num_shared_layers."),
                  (num_shared_layers is None or not (ref_model_name_or_path or ref_model_init_kwargs),
                   "num_shared_layers shares the policy's own layers; it cannot be combined with a separately loaded "
                   "reference (ref_model_name_or_path / ref_model_init_kwargs)."),
                  (num_shared_layers is None or kwargs.get("peft_config") is None,
                   "num_shared_layers does not apply to a LoRA policy: its reference is the base model with the "
                   "adapters disabled (no copy at all); drop num_shared_layers.")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        model = kwargs.get("model")
        hidden = None
        if model is not None:
            hidden = find_hidden_size(getattr(model, "config", None), model)
            if hidden is None:
                raise unknown_architecture(type(model).__name__, getattr(getattr(model, "config", None),
                                                                          "architectures", None))
        elif model_name_or_path is not None:
            hidden = hidden_size_from_folder(model_name_or_path)  # None for a hub name: found at configure_model
        if value_model_name_or_path is not None:
            hidden = hidden_size_from_folder(value_model_name_or_path)
        super().__init__(
            model_name_or_path, reward_funcs=reward_funcs, reward_weights=reward_weights,
            num_generations=num_generations, num_generations_eval=num_generations_eval,
            generation_batch_size=generation_batch_size, num_iterations=num_ppo_epochs,
            max_completion_length=max_completion_length, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, repetition_penalty=repetition_penalty, generation_kwargs=generation_kwargs,
            cache_implementation=cache_implementation, loss_type="grpo", epsilon=cliprange, beta=kl_coef,
            scale_rewards="none", mask_truncated_completions=mask_truncated_completions,
            ref_model_name_or_path=ref_model_name_or_path, ref_model_init_kwargs=ref_model_init_kwargs,
            log_entropy=log_entropy, share_prefill=share_prefill, **kwargs,
        )
        # LightningCLI hands save_hyperparameters its own config (GRPO's defaults for the knobs popped above): the
        # GRPO knobs PPO sets are set here again, or GRPO's machinery would read num_iterations 1, beta 0 ...
        knobs = dict(
            num_iterations=num_ppo_epochs, steps_per_generation=None, beta=kl_coef, epsilon=cliprange,
            epsilon_high=None, loss_type="grpo", scale_rewards="none", prompt_sharing=False,
            num_mini_batches=num_mini_batches, num_ppo_epochs=num_ppo_epochs, kl_coef=kl_coef,
            adap_kl_ctrl=adap_kl_ctrl, target=target, horizon=horizon, gamma=gamma, lam=lam,
            whiten_rewards=whiten_rewards, cliprange=cliprange, cliprange_value=cliprange_value, vf_coef=vf_coef,
            use_score_scaling=use_score_scaling, use_score_norm=use_score_norm, score_clip=score_clip,
            missing_eos_penalty=missing_eos_penalty, stop_token=stop_token,
            value_model_name_or_path=value_model_name_or_path, value_model_init_kwargs=value_model_init_kwargs,
            num_shared_layers=num_shared_layers)
        self.hparams.update(knobs)
        self._hparams_initial.update(knobs)  # what the logger writes to hparams.yaml
        self.kl_ctl = (AdaptiveKLController(kl_coef, target, horizon) if adap_kl_ctrl else FixedKLController(kl_coef))
        self.score_processor = ScoreProcessor(missing_eos_penalty, use_score_scaling, use_score_norm, score_clip)
        self.value_head = None if hidden is None else ValueHead(hidden)
        self.value_model: torch.nn.Module | None = None
        self.stat_names = self.stat_names + _PPO_STATS
        self.train_stats = torch.nn.ModuleDict({_key(k): MeanMetric(nan_strategy="ignore") for k in self.stat_names})
        self.eval_stats = torch.nn.ModuleDict({_key(k): MeanMetric(nan_strategy="ignore") for k in self.stat_names})

    check_rollout_config = staticmethod(check_ppo_rollout)

    # ------------------------------------------------------------------------------------- setup
    @property
    def rollout_shape(self) -> tuple[int, int, int]:
        """(generation_batch_size, micro-batches per rollout = num_mini_batches x accumulate_grad_batches,
        micro-batch size in completions)."""
        hp = self.hparams
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        steps = hp.num_mini_batches * accumulate
        gen = hp.generation_batch_size or hp.num_generations * steps
        return gen, steps, gen // steps

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
        if self.optimizer_factory is None and self.hparams.get("optim") is None:
            optimizer.add_param_group({"params": [head.weight], "weight_decay": self.hparams.weight_decay})
            optimizer.add_param_group({"params": [head.bias], "weight_decay": 0.0})
        else:
            optimizer.add_param_group({"params": list(head.parameters())})
        return optimizer

    # ------------------------------------------------------------------------------------- rollout
    def rewards_to_advantages(self, per_func: torch.Tensor, total: torch.Tensor, group: int) -> torch.Tensor:
        """The weighted score of each completion (GAE comes in ``_make_rollout``); a completion without a score is an
        error (the runner already refuses an infinite reward, naming the function)."""
        missing = torch.isnan(total).nonzero()
        if len(missing):
            i = int(missing[0, 0])
            names = [n for j, n in enumerate(self.reward_names) if torch.isnan(per_func[i, j])]
            raise ValueError(f"No score for completion {i} of the rollout: reward function(s) {names} returned None "
                             "or NaN for it. PPO needs a finite score for every completion (GRPO's 'not applicable' "
                             "None has no meaning here): return a number.")
        return total

    def _reuses_rollout(self, steps: int) -> bool:
        return False  # GRPO's rollout need not compute the old log-probs: _make_rollout does, with the values

    @torch.no_grad()
    def _make_rollout(self, batch: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        hp = self.hparams
        chunks = super()._make_rollout(batch)  # "advantages" holds each completion's score until here
        for mb in chunks:
            mb["old_logps"], _, mb["old_values"] = policy_forward(self.model, self.value_head, mb, hp.temperature,
                                                                  self.value_model)
        order = torch.argsort(torch.cat([mb["row"] for mb in chunks]))  # back to the rollout's order

        def rollout_order(key: str) -> torch.Tensor:
            return torch.cat([mb[key] for mb in chunks])[order]

        mask = rollout_order("completion_mask")
        logps, values = rollout_order("old_logps"), rollout_order("old_values").float() * mask
        eos = torch.tensor(eos_token_ids(self.model, self.tokenizer), device=mask.device)
        has_eos = (torch.isin(rollout_order("completion_ids"), eos) & mask.bool()).any(-1)
        scores = self.score_processor.penalize(rollout_order("advantages").float(), has_eos)
        s = self.train_stats
        s[_key("objective/scores")].update(scores.mean())
        world = self.trainer.world_size if self._trainer is not None else 1
        gather = (lambda x: self.all_gather(x).flatten()) if world > 1 else (lambda x: x)  # noqa: E731
        scores = self.score_processor.scale(scores, pool=gather(scores) if world > 1 else None)
        ref = rollout_order("ref_logps") if hp.beta > 0 else None
        coef = self.kl_ctl.value
        rewards, kl = token_rewards(scores, logps.float(), None if ref is None else ref.float(), mask, coef)
        # under DDP the whitening statistics are every rank's tokens' (what one process with the whole batch computes)
        summed = (lambda t: self.trainer.strategy.reduce(t, reduce_op="sum")) if world > 1 else None  # noqa: E731
        if hp.whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False, sum_over_ranks=summed) * mask
        advantages, returns = gae(rewards, values, mask, hp.gamma, hp.lam)
        advantages = whiten(advantages, mask, sum_over_ranks=summed) * mask
        seq_kl = kl.sum(-1)
        s[_key("objective/kl")].update(seq_kl.mean())
        s[_key("objective/entropy")].update((-logps * mask).sum(-1).mean())
        s[_key("objective/non_score_reward")].update((-coef * seq_kl).mean())
        s[_key("objective/kl_coef")].update(torch.tensor(coef, device=mask.device))
        all_kl = gather(seq_kl)
        self.kl_ctl.update(float(all_kl.mean()), int(all_kl.numel()))
        for mb in chunks:
            rows = mb["row"]
            mb["advantages"], mb["returns"], mb["old_values"] = advantages[rows], returns[rows], values[rows]
        return chunks

    # ------------------------------------------------------------------------------------- training
    def next_micro_batch(self, batch: dict[str, Any]) -> tuple[dict[str, torch.Tensor], int]:
        """GRPO's buffered micro-batch; at the start of every pass over a rollout but the first, the rollout's rows
        are dealt into new mini-batches first (``reshuffle_rollout``). A rollout of one micro-batch is not dealt:
        every pass trains on all of it anyway (and the RNG stream stays the one-pass runs')."""
        _, steps, _ = self.rollout_shape
        pos = self._buffer_pos
        new_pass = 0 < pos < steps * self.hparams.num_iterations and pos % steps == 0
        if self._buffer is not None and steps > 1 and new_pass:
            self._buffer = reshuffle_rollout([move_data_to_device(mb, self.device) for mb in self._buffer])
        return super().next_micro_batch(batch)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        mb, slot = self.next_micro_batch(batch)
        with self.training_forward_context():
            logps, logits, values = policy_forward(self.model, self.value_head, mb, hp.temperature, self.value_model)
        mask = mb["completion_mask"]
        accumulate = self.trainer.accumulate_grad_batches
        start = (slot // accumulate) * accumulate  # the optimizer step's micro-batches: its tokens normalise the loss
        step_tokens = sum(self._buffer[i]["completion_mask"].sum() for i in range(start, start + accumulate)).float()
        world = self.trainer.world_size
        if world > 1:
            step_tokens = self.trainer.strategy.reduce(step_tokens, reduce_op="sum") / world
        step_tokens = step_tokens.clamp(min=1)
        # on-policy (one pass, one mini-batch) the ratio is 1 by definition: a second forward's rounding (or dropout)
        # must not clip anything
        old = mb["old_logps"] if GRPOModule._reuses_rollout(self, self.rollout_shape[1]) else logps.detach()
        pg_loss, pg_stats = clipped_policy_loss(logps, old, mb["advantages"], mask, hp.cliprange, step_tokens)
        vf_loss, vf_stats = clipped_value_loss(values, mb["old_values"], mb["returns"], mask, hp.cliprange_value,
                                               step_tokens)
        loss = pg_loss + hp.vf_coef * vf_loss if hp.vf_coef > 0 else pg_loss
        s = self.train_stats
        s[_key("loss")].update(loss.detach() * accumulate)
        s[_key("loss/policy")].update(pg_loss.detach() * accumulate)
        s[_key("val/value_loss")].update(vf_loss.detach() * accumulate)
        s[_key("policy/approxkl")].update(pg_stats["approxkl"])
        s[_key("policy/clipfrac")].update(pg_stats["clipfrac"])
        s[_key("val/clipfrac")].update(vf_stats["clipfrac"])
        s[_key("val/explained_variance")].update(explained_variance(values.detach(), mb["returns"], mask))
        if hp.log_entropy and mask.any():
            with torch.no_grad():
                s[_key("policy/entropy")].update(masked_mean(token_entropies(logits), mask))
        return self.add_router_aux_loss(loss * accumulate)

    # ------------------------------------------------------------------------------------- state and export
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """GRPO's (rollout buffer with its advantages, returns and values, RNG) plus the KL controller and the score
        statistics (the same on every rank: both are updated from every rank's rollout)."""
        super().on_save_checkpoint(checkpoint)
        checkpoint["lightalign_ppo"] = {"kl_ctl": self.kl_ctl.state_dict(),
                                        "score_moments": self.score_processor.state_dict()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("lightalign_ppo", {})
        if "kl_ctl" in state:
            self.kl_ctl.load_state_dict(state["kl_ctl"])
        if "score_moments" in state:
            self.score_processor.load_state_dict(state["score_moments"])

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
        its weights (``modules/training/value_head.py``: ``load_value_head``). ``extras``: ``gather_export_extras()``'s,
        required when the module is sharded."""
        extras = extras if extras is not None else self.gather_export_extras()
        path = super().export_hf(output_dir, tokenizer=tokenizer, merge_lora=merge_lora, state_dict=state_dict)
        self.value_head.save(path, extras["value_head"])
        if self.value_model is not None:
            self.value_model.save_pretrained(path / "value_model", safe_serialization=True,
                                             state_dict=extras.get("value_model"))
        return path
