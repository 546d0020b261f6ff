"""Group relative policy optimisation: ``GRPOModule`` (rollouts, rewards, advantages, the clipped loss).

The loss itself is the pure function ``grpo_loss`` (``modules/losses/grpo.py``), re-exported here; sampling,
scoring and buffering a rollout are ``GRPORollout`` (``modules/rollout/grpo_rollout.py``), the entropy coefficient and
token mask ``modules/losses/entropy.py``.

Rollout reuse under automatic optimisation: ``PromptDataModule`` hands each generation batch of prompts to
``steps_per_generation x num_iterations`` consecutive ``training_step`` calls; the first generates
``generation_batch_size`` completions (``num_generations`` per prompt), scores them and buffers them split into
``steps_per_generation`` micro-batches; the following calls consume the buffer. Lightning's accumulation,
clipping, precision and strategies are untouched.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics.aggregation import MeanMetric

from lightalign.modules.training.policy import PolicyModule, is_peft_model
from lightalign.modules.losses.entropy import SENTINEL, EntropyController, high_entropy_mask
from lightalign.modules.generation.sampling import check_generation_arithmetic, check_rollout_config
from lightalign.modules.rollout.grpo_knobs import check_grpo_knobs
from lightalign.modules.losses.grpo import GLOBAL_TOKEN_LOSS_TYPES, GRPO_LOSS_TYPES, grpo_loss
from lightalign.modules.rollout.grpo_rollout import GRPORollout, _key
from lightalign.modules.training.rng_state import gather_per_rank, to_cpu
from lightalign.modules.reference.model import build_reference, move_reference
from lightalign.rewards import RunningRewardNormalizer, check_reward_weights, reward_func_names, resolve_reward_funcs

__all__ = ["GRPO_LOSS_TYPES", "GRPOModule", "grpo_loss"]


class GRPOModule(GRPORollout, PolicyModule):
    """GRPO on the prompt batches of ``PromptDataModule`` (TRL's knob names and defaults).

    Args:
        reward_funcs: reward functions ``fn(prompts, completions, **columns) -> list[float | None]``: callables,
            import paths (``lightalign.rewards.accuracy_reward``, ``mypkg.rewards:fn``) or reward-model folders.
        reward_weights: one weight per reward function (default 1 each); the reward is their weighted sum.
        multi_objective_aggregation: ``sum_then_normalize`` (default): weighted sum of the rewards, then
            ``scale_rewards``; ``normalize_then_sum`` (GDPO): each function's rewards are normalised within each
            group (``(r - mean) / (std + 1e-4)``), weighted and summed, and the sum is normalised over the whole
            generation batch (every rank's); ``scale_rewards`` is then not used, and ``normalize_rewards`` /
            ``reward_clip`` (lightalign's, on the summed reward) are refused with it.
        num_generations: completions per prompt (the group).
        num_generations_eval: completions per validation prompt (default ``num_generations``).
        generation_batch_size: completions per rollout per device (default ``num_generations x
            steps_per_generation``); must be divisible by ``num_generations`` and by ``steps_per_generation``.
        steps_per_generation: training micro-batches one rollout is split into (default: the trainer's
            ``accumulate_grad_batches``, i.e. one rollout per optimizer step).
        num_iterations: how many times each rollout is trained on (PPO-style reuse, TRL's μ).
        max_completion_length: generated tokens at most.
        temperature, top_p, top_k, min_p, repetition_penalty: sampling knobs of ``generate``.
        generation_kwargs: more ``generate`` arguments (``GenerationConfig`` fields such as ``suppress_tokens``,
            ``no_repeat_ngram_size``); the ones this module sets (``max_new_tokens``, ``num_return_sequences``,
            ``temperature``, ``top_p`` ...) are refused with the knob to use. (TRL lets them override its knobs.)
        cache_implementation: ``generate``'s KV-cache implementation (e.g. ``static``); needs ``share_prefill:
            false`` and the ``generate`` backend.
        generation_backend: what samples the rollouts (``modules/generation/backends.py``): ``generate``
            (``model.generate``, prompt prefill shared; any knob), ``continuous`` (transformers' continuous
            batching, paged KV cache: finished completions leave the batch; refuses ``repetition_penalty``,
            ``generation_kwargs``, ``cache_implementation``), ``static`` (static KV cache, compiled decode step) or
            ``compact`` (lightalign's loop: finished completions leave the batch; refuses ``generation_kwargs``,
            ``cache_implementation``; one process).
            Unset: ``compact`` on a CPU (measured fastest there, docs/performance.md), ``generate`` elsewhere (GPUs
            not measured; ``generation_backends.DEFAULT_BACKEND``), and ``generate`` whenever ``compact`` cannot
            serve: a knob only ``generate`` honours, several processes, a model without a plain KV cache, or greedy
            tokens that differ from ``generate``'s on the model's probe (``adaptations.check_layout``); the
            fit-start line says which and why. An asked backend that the probe measures not exact is refused.
        use_transformers_continuous_batching: TRL's name for ``generation_backend: continuous``.
        transformers_continuous_batching_config: ``ContinuousBatchingConfig`` fields for ``continuous`` (e.g.
            ``page_size``, ``num_blocks``; by default the paged cache is sized from the rollout).
        loss_type: ``dapo`` (default) | ``grpo`` | ``bnpo`` | ``dr_grpo`` | ``cispo`` | ``sapo`` | ``luspo`` |
            ``vespo`` (formulas: ``grpo_loss``). ``cispo`` needs ``epsilon_high`` (the ratio cap, e.g. 5.0);
            ``luspo`` needs ``importance_sampling_level: sequence`` and ``beta: 0``. ``dapo`` divides by the completion
            tokens of each optimizer step's own micro-batches; when ``steps_per_generation`` exceeds
            ``accumulate_grad_batches`` TRL 1.16 divides by the rollout's tokens times ``accumulate / steps``
            (an average over the rollout) instead. Deliberately: each step's gradient is then the token mean of
            exactly the tokens it trains on, whatever the lengths in the rollout's other steps.
        epsilon, epsilon_high: clipping range ``[1 - epsilon, 1 + epsilon_high]`` of the importance ratio.
        delta: two-sided clipping (INTELLECT-2): the unclipped branch uses ``min(ratio, delta)``; > 1, e.g. 4.0.
        importance_sampling_level: ``token`` (default) or ``sequence`` (GSPO: each completion's mean log-ratio,
            one ratio per completion).
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures for positive / other advantages.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's Gamma weight ``w^k exp(-lambda w)``
            for non-negative / negative advantages.
        off_policy_mask_threshold: drop completions with a negative advantage whose mean ``log pi_old - log pi``
            exceeds it (DeepSeek-V3.2). Only acts when the rollout is reused (``num_iterations > 1`` or
            ``steps_per_generation > accumulate_grad_batches``); otherwise the policy is the sampler.
        top_entropy_quantile: keep in the policy term only the tokens whose entropy is in the top quantile of the
            micro-batch's tokens (every rank's); 1.0 keeps all, the paper uses 0.2. The KL term keeps every token.
        entropy_coef: entropy bonus ``loss -= entropy_coef * mean token entropy`` (of the kept tokens).
        use_adaptive_entropy, entropy_coef_min, entropy_coef_max, entropy_coef_delta, entropy_target: adaptive
            entropy control (Skywork-OR1): after each optimizer step ``entropy_coef`` moves by ``entropy_coef_delta``
            (up while the step's mean entropy is <= ``entropy_target``, else down, within [min, max]) and applies
            only while the last step's entropy is <= ``entropy_target``. Its state is in the checkpoint.
        beta: KL coefficient (k3 estimator) against a reference model, which is built only when ``beta > 0``.
        use_bias_correction_kl: multiply the k3 term by the importance ratio (DeepSeek-V3.2's unbiased estimate;
            on by default, as in TRL 1.16; no effect when ``beta`` is 0).
        scale_rewards: advantage scaling: ``group`` std, ``batch`` std, or ``none``.
        normalize_rewards: normalise rewards by their running mean/std before the advantages (statistics of
            the whole generation batch, every rank's, so all ranks keep the same ones).
        reward_clip: clip (normalised) rewards to ``[-reward_clip, reward_clip]``.
        mask_truncated_completions: completions that hit ``max_completion_length`` without EOS get no loss.
        ref_model_name_or_path, ref_model_init_kwargs: a separately loaded reference (when ``beta > 0``).
        log_entropy: log the mean token entropy of the policy on its completions.
        share_prefill: compute each prompt's prefill once and copy its KV cache to the ``num_generations``
            completions (same completions as plain ``generate``; turn off for models whose cache is not a
            ``DynamicCache``).
        prompt_sharing: train on each micro-batch in the shared-prefix layout: a prompt's tokens go through the
            model once for all of its completions in the micro-batch (one ``[prompt, completion_1, ...]``
            segment, position ids restarting after the prompt, a mask keeping completions apart), equal to the
            padded layout within float tolerance. Worth it for long prompts; the rollout is then shuffled by
            whole groups so a micro-batch holds whole groups. Needs ``sdpa`` or ``eager`` attention.
        pack_length: with ``prompt_sharing``, a micro-batch of ``T`` tokens is split into
            ``ceil(T / pack_length)`` rows of balanced length (``datamodules/shared_prefix.py``).
        padding_free: train on each micro-batch with no padding: every ``[prompt, completion]`` one after the
            other in one row, positions restarting at each, one attention call per sequence (``sdpa_varlen``);
            old and reference log-probs are computed the same way. Equal to the padded layout within float
            tolerance; refused at fit start on models that cannot run it exactly (ALiBi, ...). Worth it when
            completion lengths vary (reasoning workloads). Not with ``prompt_sharing`` (pick one). TRL's GRPO has
            no such knob; the name is the one TRL's SFT and DPO use for the same idea.
        use_vllm, vllm_mode, vllm_server_base_url, vllm_server_host, vllm_server_port, vllm_server_timeout,
            vllm_group_port, vllm_gpu_memory_utilization, vllm_tensor_parallel_size, vllm_max_model_length,
            vllm_enable_sleep_mode, vllm_model_impl: sample rollouts with vLLM on a GPU (TRL's names and
            defaults; ``modules/generation/vllm.py``, docs/vllm.md). Refused without CUDA.
        **kwargs: ``PolicyModule`` arguments (model, LoRA, optimizer, schedule).
    """

    uses_reference_model = True
    check_rollout_config = staticmethod(check_rollout_config)  # PPOModule's own allows one completion per prompt

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        reward_funcs: list[str | Callable] | str | Callable | None = None,
        reward_weights: list[float] | None = None,
        multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize",
        num_generations: int = 8,
        num_generations_eval: int | None = None,
        generation_batch_size: int | None = None,
        steps_per_generation: int | None = None,
        num_iterations: int = 1,
        max_completion_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        generation_kwargs: dict[str, Any] | None = None,
        cache_implementation: str | None = None,
        generation_backend: Literal["generate", "continuous", "static", "compact"] | None = None,
        use_transformers_continuous_batching: bool = False,
        transformers_continuous_batching_config: dict[str, Any] | None = None,
        loss_type: Literal["dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"] = "dapo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        importance_sampling_level: Literal["token", "sequence"] = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        off_policy_mask_threshold: float | None = None,
        top_entropy_quantile: float = 1.0,
        entropy_coef: float = 0.0,
        use_adaptive_entropy: bool = False,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
        entropy_coef_delta: float = 0.005,
        entropy_target: float = 0.2,
        beta: float = 0.0,
        use_bias_correction_kl: bool = True,
        scale_rewards: Literal["group", "batch", "none"] = "group",
        normalize_rewards: bool = False,
        reward_clip: float | None = None,
        mask_truncated_completions: bool = False,
        ref_model_name_or_path: str | None = None,
        ref_model_init_kwargs: dict[str, Any] | None = None,
        log_entropy: bool = True,
        share_prefill: bool = True,
        prompt_sharing: bool = False,
        pack_length: int = 1024,
        padding_free: bool = False,
        use_vllm: bool = False,
        vllm_mode: Literal["colocate", "server"] = "colocate",
        vllm_server_base_url: str | None = None,
        vllm_server_host: str = "0.0.0.0",
        vllm_server_port: int = 8000,
        vllm_server_timeout: float = 240.0,
        vllm_group_port: int = 51216,
        vllm_gpu_memory_utilization: float = 0.3,
        vllm_tensor_parallel_size: int = 1,
        vllm_max_model_length: int | None = None,
        vllm_enable_sleep_mode: bool = False,
        vllm_model_impl: Literal["vllm", "transformers"] = "vllm",
        **kwargs: Any,
    ) -> None:
        check_grpo_knobs({k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")})
        if reward_funcs is None:
            raise ValueError("GRPOModule needs reward_funcs: callables or import paths of fn(prompts, completions, **columns).")
        specs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        funcs = resolve_reward_funcs(list(specs))
        check_reward_weights(funcs, reward_weights)
        self.check_rollout_config(num_generations, num_iterations, steps_per_generation, generation_batch_size, pack_length)
        super().__init__(model_name_or_path, **kwargs)
        self.save_hyperparameters(ignore=["model", "optimizer", "lr_scheduler", "eval_metrics", "reward_funcs"])
        self.reward_funcs = funcs
        self.reward_names = reward_func_names(funcs)
        self.reward_normalizer = RunningRewardNormalizer() if normalize_rewards else None
        self.entropy_control = EntropyController(entropy_coef, use_adaptive_entropy, entropy_target, entropy_coef_delta,
                                                 entropy_coef_min, entropy_coef_max)
        self.ref_model: torch.nn.Module | None = None
        self.tokenizer: Any = None
        self.generation_count = 0
        self._buffer: list[dict[str, torch.Tensor]] | None = None
        self._buffer_pos = 0
        self.last_samples: list[dict[str, Any]] = []
        stat_names = ["loss", "clip_ratio", "clip_ratio/low", "clip_ratio/high", "kl", "entropy", "reward/mean",
                      "reward/std", "completions/mean_length", "completions/clipped_ratio", "policy_loss", "entropy_coef",
                      "vespo/phi_seq_mean"]
        stat_names += [f"reward/{n}" for n in self.reward_names]
        self.stat_names = stat_names
        self.train_stats = torch.nn.ModuleDict({_key(k): MeanMetric(nan_strategy="ignore") for k in stat_names})
        self.eval_stats = torch.nn.ModuleDict({_key(k): MeanMetric(nan_strategy="ignore") for k in stat_names})

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("ref_model", "reward_funcs", "entropy_control"):  # not submodules: never optimised or checkpointed
            self.__dict__[name] = value
            return
        super().__setattr__(name, value)

    # ------------------------------------------------------------------------------------- setup
    @property
    def rollout_shape(self) -> tuple[int, int, int]:
        """(generation_batch_size, steps_per_generation, micro-batch size in completions), resolved."""
        hp = self.hparams
        steps = hp.steps_per_generation or (self.trainer.accumulate_grad_batches if self._trainer is not None else 1)
        gen = hp.generation_batch_size or hp.num_generations * steps
        return gen, steps, gen // steps

    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None)
        self.tokenizer = getattr(datamodule, "tokenizer", None)
        if stage != "fit":
            return
        gen, steps, _ = self.rollout_shape
        check_generation_arithmetic(gen, self.hparams.num_generations, steps)
        accumulate = self.trainer.accumulate_grad_batches
        if self.hparams.loss_type in GLOBAL_TOKEN_LOSS_TYPES and steps % accumulate:
            raise ValueError(
                f"loss_type='{self.hparams.loss_type}' normalises by the completion tokens of each optimizer step, so an optimizer step "
                f"must not straddle two rollouts: steps_per_generation ({steps}) must be a multiple of "
                f"accumulate_grad_batches ({accumulate})."
            )
        if self.hparams.off_policy_mask_threshold is not None and not self._reuses_rollout(steps):
            rank_zero_warn("off_policy_mask_threshold has no effect here: every rollout is trained on once, by the "
                           "policy that sampled it (num_iterations=1, steps_per_generation <= accumulate_grad_batches).")
        if not hasattr(datamodule, "configure_rollout"):
            raise TypeError(f"GRPOModule trains on PromptDataModule batches; got {type(datamodule).__name__}.")
        datamodule.configure_rollout(gen // self.hparams.num_generations, steps * self.hparams.num_iterations)

    def configure_model(self) -> None:
        super().configure_model()
        hp = self.hparams
        if hp.beta > 0 and self.ref_model is None and not is_peft_model(self.model):
            with torch.inference_mode(False):
                self.ref_model = build_reference(
                    self.model, hp.ref_model_name_or_path or self.model_name_or_path,
                    separate=bool(hp.ref_model_name_or_path or hp.ref_model_init_kwargs),
                    init_kwargs=hp.ref_model_init_kwargs, trust_remote_code=hp.trust_remote_code,
                    num_shared_layers=hp.get("num_shared_layers"),  # PPOModule's knob
                )

    def configure_callbacks(self) -> list:
        callbacks = super().configure_callbacks()
        if self.hparams.get("use_vllm"):  # the engine, its weight pushes and the sampler (modules/generation/vllm_engines.py)
            from lightalign.modules.generation.vllm_engines import VLLMRollouts

            callbacks.append(VLLMRollouts())
        return callbacks

    def on_fit_start(self) -> None:
        self._sampling_backend = None  # decided again in fit_start_notes (the model may have changed)
        super().on_fit_start()  # the layout check, NEFTune when asked
        move_reference(self.ref_model, self.device, self.model, self.hparams.ref_model_init_kwargs)

    def fit_start_notes(self) -> list[str]:
        """The generation backend, decided (and measured) here, before any rollout: an inexact asked backend or
        shared prefill is refused at fit start."""
        if self.hparams.get("use_vllm"):
            return []
        self.sampling_backend()
        return [self.sampling_note]

    def batch_layout(self) -> tuple[str, int | None]:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        prompt = getattr(datamodule, "max_prompt_length", None)
        longest = None if prompt is None else prompt + self.hparams.max_completion_length
        hp = self.hparams
        layout = "grpo_shared" if hp.prompt_sharing else "grpo_packed" if hp.get("padding_free") else "grpo_padded"
        return layout, longest

    # ------------------------------------------------------------------------------------- training
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        mb, slot = self.next_micro_batch(batch)
        control = self.entropy_control
        with self.training_forward_context():
            logps, entropies = self.token_logps(self.model, mb, entropy_grad=control.enabled,
                                                with_entropy=hp.log_entropy or control.enabled or hp.top_entropy_quantile < 1)
        mask = mb["completion_mask"].bool()
        entropy_mask = None if hp.top_entropy_quantile >= 1 else self._high_entropy_mask(entropies.detach(), mask)
        accumulate = self.trainer.accumulate_grad_batches
        num_items, scale = None, 1.0
        if hp.loss_type in GLOBAL_TOKEN_LOSS_TYPES:
            start = (slot // accumulate) * accumulate
            step_tokens = sum(self._buffer[i]["completion_mask"].sum() for i in range(start, start + accumulate))
            world = self.trainer.world_size
            if world > 1:
                step_tokens = self.trainer.strategy.reduce(step_tokens.float(), reduce_op="sum") / world
            num_items, scale = step_tokens, float(accumulate)
        loss, stats = grpo_loss(
            logps, mb.get("old_logps"), mb["advantages"], mb["completion_mask"], loss_type=hp.loss_type,
            epsilon=hp.epsilon, epsilon_high=hp.epsilon_high, beta=hp.beta, ref_per_token_logps=mb.get("ref_logps"),
            max_completion_length=hp.max_completion_length, num_items_in_batch=num_items,
            importance_sampling_level=hp.importance_sampling_level, delta=hp.delta,
            sapo_temperature_pos=hp.sapo_temperature_pos, sapo_temperature_neg=hp.sapo_temperature_neg,
            vespo_k_pos=hp.vespo_k_pos, vespo_lambda_pos=hp.vespo_lambda_pos, vespo_k_neg=hp.vespo_k_neg,
            vespo_lambda_neg=hp.vespo_lambda_neg, off_policy_mask_threshold=hp.off_policy_mask_threshold,
            use_bias_correction_kl=hp.use_bias_correction_kl, entropy_mask=entropy_mask,
            entropies=entropies if control.enabled else None, entropy_coef=control.applied_coef(),
            loss_scale=scale,
        )
        if control.enabled:
            selected = mask if entropy_mask is None else entropy_mask
            control.observe((entropies.detach() * selected).sum(), selected.sum())
        s = self.train_stats
        s[_key("loss")].update(loss.detach())
        for name, key in (("clip_ratio", "clip_ratio/region_mean"), ("clip_ratio/low", "clip_ratio/low_mean"),
                          ("clip_ratio/high", "clip_ratio/high_mean"), ("kl", "kl"), ("policy_loss", "policy_loss"),
                          ("vespo/phi_seq_mean", "vespo/phi_seq_mean")):
            if key in stats:
                s[_key(name)].update(stats[key])
        if entropies is not None and mask.any():
            s[_key("entropy")].update(entropies.detach()[mask].mean())
        return self.add_router_aux_loss(loss * scale)

    def _high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``top_entropy_quantile``'s token mask; the quantile is over every rank's real tokens of this step."""
        pool = None
        if self.trainer.world_size > 1:
            local = entropies[mask].float()
            longest = int(self.all_gather(torch.tensor(local.numel(), device=local.device)).max())
            padded = torch.full((longest,), SENTINEL, device=local.device)
            padded[: local.numel()] = local
            pool = self.all_gather(padded).flatten()
        return high_entropy_mask(entropies, mask, self.hparams.top_entropy_quantile, pool=pool)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        control = self.entropy_control
        if control.enabled:  # the adaptive update takes effect from the next optimizer step on (as TRL)
            world = self.trainer.world_size
            control.step((lambda x: self.trainer.strategy.reduce(x.to(self.device), reduce_op="sum").cpu())
                         if world > 1 else None)
            self.train_stats[_key("entropy_coef")].update(torch.tensor(control.coef, device=self.device))
        self._log_stats(self.train_stats, "train")

    def _log_stats(self, stats: torch.nn.ModuleDict, stage: str) -> None:
        for name in self.stat_names:
            metric = stats[_key(name)]
            if metric.update_called:
                self.log(f"{stage}/{name}", metric.compute(), prog_bar=name in ("reward/mean",))
            metric.reset()

    # ------------------------------------------------------------------------------------- validation
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Sample ``num_generations`` completions per validation prompt and score them (no loss).

        Sampling uses its own seeded stream, so validating does not change the training rollouts (and a run
        resumed from a checkpoint samples exactly what the uninterrupted run sampled)."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.global_step * 100_003 + batch_idx)
            group = self.hparams.num_generations_eval or self.hparams.num_generations
            rollout = self.generate(batch, group)
        last_samples = self.last_samples
        self.score(rollout, self.eval_stats, group)
        self.last_samples = last_samples  # the sample table shows training rollouts

    def on_validation_epoch_end(self) -> None:
        self._log_stats(self.eval_stats, "val")
        self.log_eval_metrics("val")

    # ------------------------------------------------------------------------------------- state
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Every rank's rollout buffer and reward normaliser (rank order): under DDP each rank trains on its own
        prompts, so each resumes its own (every rank gathers; rank 0 writes)."""
        super().on_save_checkpoint(checkpoint)
        checkpoint["lightalign_grpo"] = {"generation_count": self.generation_count,
                                         "entropy_control": self.entropy_control.state_dict(),
                                         "ranks": gather_per_rank(self._rank_state())}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("lightalign_grpo", {})
        self.generation_count = state.get("generation_count", 0)
        if "entropy_control" in state:  # the same on every rank (its window is reduced over ranks)
            self.entropy_control.load_state_dict(state["entropy_control"])
        ranks = state.get("ranks", [state])  # (checkpoints before per-rank state held rank 0's at the top level)
        world = self.trainer.world_size if self._trainer is not None else 1
        if len(ranks) != world:
            rank_zero_warn(f"This checkpoint holds the rollout state of {len(ranks)} rank(s) and the run has {world}: "
                           "the rollout in progress is dropped (the next training step generates a new one), so the "
                           "run does not continue exactly as it would have.")
            ranks = [{}] * world
        own = ranks[self.global_rank if self._trainer is not None else 0]
        self._buffer, self._buffer_pos = own.get("buffer"), own.get("buffer_pos", 0)
        if self.reward_normalizer is not None and "reward_normalizer" in own:
            self.reward_normalizer.load_state_dict(own["reward_normalizer"])

    def _rank_state(self) -> dict[str, Any]:
        """This rank's rollout buffer (on the CPU), its position, and its reward normaliser's statistics."""
        buffer = None if self._buffer is None else [to_cpu(mb) for mb in self._buffer]
        state = {"buffer": buffer, "buffer_pos": self._buffer_pos}
        if self.reward_normalizer is not None:
            state["reward_normalizer"] = self.reward_normalizer.state_dict()
        return state

