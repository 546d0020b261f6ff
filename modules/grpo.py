"""Group relative policy optimisation: ``GRPOModule`` (rollouts, rewards, advantages, the clipped loss).

The loss itself is the pure function ``grpo_loss`` (``modules/grpo_loss.py``), re-exported here.

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
from lightning.fabric.utilities.apply_func import move_data_to_device
from torchmetrics.aggregation import MeanMetric

from lightalign.modules.base import PolicyModule, is_peft_model
from lightalign.modules.generation import (check_generation_arithmetic, check_rollout_config, sample_completions,
                                           split_rollout)
from lightalign.modules.grpo_loss import GRPO_LOSS_TYPES, grpo_loss, validate_grpo_loss_config
from lightalign.modules.layouts import grpo_forward, prompt_group_batch
from lightalign.modules.logprobs import mean_entropy
from lightalign.modules.rng_state import gather_per_rank, to_cpu
from lightalign.modules.reference import build_reference, move_reference
from lightalign.rewards import (
    RunningRewardNormalizer,
    check_reward_weights,
    clip_rewards,
    compute_rewards,
    resolve_reward_funcs,
    nanstd,
    reward_func_names,
    scale_advantages,
)

__all__ = ["GRPO_LOSS_TYPES", "GRPOModule", "grpo_loss"]

SCALE_REWARDS = ("group", "batch", "none")


class GRPOModule(PolicyModule):
    """GRPO on the prompt batches of ``PromptDataModule`` (TRL's knob names and defaults).

    Args:
        reward_funcs: reward functions ``fn(prompts, completions, **columns) -> list[float | None]``: callables,
            import paths (``lightalign.rewards.accuracy_reward``, ``mypkg.rewards:fn``) or reward-model folders.
        reward_weights: one weight per reward function (default 1 each); the reward is their weighted sum.
        num_generations: completions per prompt (the group).
        generation_batch_size: completions per rollout per device (default ``num_generations x
            steps_per_generation``); must be divisible by ``num_generations`` and by ``steps_per_generation``.
        steps_per_generation: training micro-batches one rollout is split into (default: the trainer's
            ``accumulate_grad_batches``, i.e. one rollout per optimizer step).
        num_iterations: how many times each rollout is trained on (PPO-style reuse, TRL's μ).
        max_completion_length: generated tokens at most.
        temperature, top_p, top_k, min_p, repetition_penalty: sampling knobs of ``generate``.
        loss_type: ``dapo`` (default) | ``grpo`` | ``bnpo`` | ``dr_grpo``. ``dapo`` divides by the completion
            tokens of each optimizer step's own micro-batches; when ``steps_per_generation`` exceeds
            ``accumulate_grad_batches`` TRL 1.16 divides by the rollout's tokens times ``accumulate / steps``
            (an average over the rollout) instead. Deliberately: each step's gradient is then the token mean of
            exactly the tokens it trains on, whatever the lengths in the rollout's other steps.
        epsilon, epsilon_high: clipping range ``[1 - epsilon, 1 + epsilon_high]`` of the importance ratio.
        beta: KL coefficient (k3 estimator) against a reference model, which is built only when ``beta > 0``.
        scale_rewards: advantage scaling: ``group`` std, ``batch`` std, or ``none``.
        normalize_rewards: normalise rewards by their running mean/std before the advantages.
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
        **kwargs: ``PolicyModule`` arguments (model, LoRA, optimizer, schedule).
    """

    uses_reference_model = True

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        reward_funcs: list[str | Callable] | str | Callable | None = None,
        reward_weights: list[float] | None = None,
        num_generations: int = 8,
        generation_batch_size: int | None = None,
        steps_per_generation: int | None = None,
        num_iterations: int = 1,
        max_completion_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        loss_type: Literal["dapo", "grpo", "bnpo", "dr_grpo"] = "dapo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
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
        **kwargs: Any,
    ) -> None:
        validate_grpo_loss_config(loss_type, epsilon, epsilon_high, beta, max_completion_length)
        if reward_funcs is None:
            raise ValueError("GRPOModule needs reward_funcs: callables or import paths of fn(prompts, completions, **columns).")
        specs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        funcs = resolve_reward_funcs(list(specs))
        check_reward_weights(funcs, reward_weights)
        if scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards='{scale_rewards}' is unknown; use one of {list(SCALE_REWARDS)}.")
        check_rollout_config(num_generations, num_iterations, steps_per_generation, generation_batch_size, pack_length)
        if reward_clip is not None and reward_clip <= 0:
            raise ValueError(f"reward_clip must be > 0 or null, got {reward_clip}.")
        super().__init__(model_name_or_path, **kwargs)
        self.save_hyperparameters(ignore=["model", "optimizer", "lr_scheduler", "eval_metrics", "reward_funcs"])
        self.reward_funcs = funcs
        self.reward_names = reward_func_names(funcs)
        self.reward_normalizer = RunningRewardNormalizer() if normalize_rewards else None
        self.ref_model: torch.nn.Module | None = None
        self.tokenizer: Any = None
        self.generation_count = 0
        self._buffer: list[dict[str, torch.Tensor]] | None = None
        self._buffer_pos = 0
        self.last_samples: list[dict[str, Any]] = []
        stat_names = ["loss", "clip_ratio", "clip_ratio/low", "clip_ratio/high", "kl", "entropy", "reward/mean",
                      "reward/std", "completions/mean_length", "completions/clipped_ratio"]
        stat_names += [f"reward/{n}" for n in self.reward_names]
        self.stat_names = stat_names
        self.train_stats = torch.nn.ModuleDict({_key(k): MeanMetric(nan_strategy="ignore") for k in stat_names})
        self.eval_stats = torch.nn.ModuleDict({_key(k): MeanMetric(nan_strategy="ignore") for k in stat_names})

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("ref_model", "reward_funcs"):  # not submodules: never optimised or checkpointed
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
        if self.hparams.loss_type == "dapo" and steps % accumulate:
            raise ValueError(
                f"loss_type='dapo' normalises by the completion tokens of each optimizer step, so an optimizer step "
                f"must not straddle two rollouts: steps_per_generation ({steps}) must be a multiple of "
                f"accumulate_grad_batches ({accumulate})."
            )
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
                )

    def on_fit_start(self) -> None:
        super().on_fit_start()  # the layout check, NEFTune when asked
        move_reference(self.ref_model, self.device)

    def batch_layout(self) -> tuple[str, int | None]:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        prompt = getattr(datamodule, "max_prompt_length", None)
        longest = None if prompt is None else prompt + self.hparams.max_completion_length
        return ("grpo_shared" if self.hparams.prompt_sharing else "grpo_padded"), longest

    # ------------------------------------------------------------------------------------- rollout
    @torch.no_grad()
    def generate(self, batch: dict[str, Any], num_generations: int) -> dict[str, Any]:
        """Sample ``num_generations`` completions per prompt (``generation.sample_completions``)."""
        hp = self.hparams
        return sample_completions(
            self.model, self.tokenizer, batch, num_generations, share_prefill=hp.share_prefill,
            temperature=hp.temperature, top_p=hp.top_p, top_k=hp.top_k or 0, min_p=hp.min_p,
            repetition_penalty=hp.repetition_penalty, max_new_tokens=hp.max_completion_length,
        )

    def score(self, rollout: dict[str, Any], stats: torch.nn.ModuleDict) -> torch.Tensor:
        """Rewards -> (normalised, clipped) -> group-relative advantages; logs the reward statistics."""
        hp = self.hparams
        per_func, total = compute_rewards(self.reward_funcs, rollout["prompts"], rollout["completions"],
                                          rollout["columns"], hp.reward_weights)
        total = total.to(self.device).float()
        if (~torch.isnan(total)).any():  # a completion no function could score has a NaN total (as in TRL)
            stats[_key("reward/mean")].update(torch.nanmean(total))
            stats[_key("reward/std")].update(nanstd(total))
        for j, name in enumerate(self.reward_names):
            column = per_func[:, j]
            if (~torch.isnan(column)).any():
                stats[_key(f"reward/{name}")].update(torch.nanmean(column.float()))
        lengths = rollout["completion_mask"].sum(-1).float()
        stats[_key("completions/mean_length")].update(lengths.mean())
        stats[_key("completions/clipped_ratio")].update(rollout["truncated"].float().mean())
        self.last_samples = [
            {"step": self.global_step, "prompt": p if isinstance(p, str) else p[-1]["content"], "completion": t,
             "reward": float(r), **{n: float(per_func[i, j]) for j, n in enumerate(self.reward_names)}}
            for i, (p, t, r) in enumerate(zip(rollout["prompts"], rollout["texts"], total.tolist()))
        ]
        if not self.training and (self.eval_metric_objects or self.eval_metric_fns):
            scored = total[~torch.isnan(total)]  # eval_metrics see each scored completion's total reward, and ones
            self.update_eval_metrics(scored, torch.ones_like(scored, dtype=torch.long))
        rewards = total
        if self.reward_normalizer is not None and self.training:
            rewards = self.reward_normalizer.normalize(rewards)
        rewards = clip_rewards(rewards, hp.reward_clip)
        batch_rewards = None  # "batch" divides by the std of every rank's rewards (TRL gathers them too)
        if hp.scale_rewards == "batch" and self._trainer is not None and self.trainer.world_size > 1:
            batch_rewards = self.all_gather(rewards).flatten()
        return scale_advantages(rewards, hp.num_generations, hp.scale_rewards, batch_rewards=batch_rewards)

    def token_logps(self, model: torch.nn.Module, mb: dict[str, Any], with_entropy: bool = False):
        """Per-token log-probs of the completion tokens ``[B, T]`` (and the mean entropy, detached)."""
        logps, logits, scored = grpo_forward(model, mb, self.hparams.temperature)
        return logps, (mean_entropy(logits, scored) if with_entropy else None)

    @torch.no_grad()
    def _make_rollout(self, batch: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        hp = self.hparams
        gen, steps, _ = self.rollout_shape
        prompts_expected = gen // hp.num_generations
        if len(batch["prompts"]) != prompts_expected:
            raise ValueError(f"Expected {prompts_expected} prompts per rollout (generation_batch_size {gen} / "
                             f"num_generations {hp.num_generations}), got {len(batch['prompts'])}.")
        rollout = self.generate(batch, hp.num_generations)
        self.generation_count += 1
        advantages = self.score(rollout, self.train_stats)
        lengths = rollout["completion_mask"].sum(-1)  # generated tokens through EOS, before any masking
        if hp.mask_truncated_completions:
            rollout["completion_mask"] = rollout["completion_mask"] * (~rollout["truncated"]).long().unsqueeze(-1)
        tensors = {k: rollout[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        tensors["advantages"] = advantages
        chunks = split_rollout(tensors, lengths, steps, hp.num_generations, whole_groups=hp.prompt_sharing)
        pad = self.tokenizer.pad_token_id
        for mb in chunks:
            lengths = mb.pop("lengths")
            if hp.prompt_sharing:
                mb["shared"] = prompt_group_batch(mb, pad if pad is not None else 0, hp.pack_length, lengths)
        needs_old = hp.num_iterations > 1 or steps > self.trainer.accumulate_grad_batches
        for mb in chunks:
            if needs_old:
                mb["old_logps"], _ = self.token_logps(self.model, mb)
            if hp.beta > 0:
                if self.ref_model is not None:
                    mb["ref_logps"], _ = self.token_logps(self.ref_model, mb)
                else:
                    with self.model.disable_adapter():
                        mb["ref_logps"], _ = self.token_logps(self.model, mb)
        return chunks

    # ------------------------------------------------------------------------------------- training
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        _, steps, _ = self.rollout_shape
        if self._buffer is None or self._buffer_pos >= steps * hp.num_iterations:
            self._buffer = self._make_rollout(batch)
            self._buffer_pos = 0
        slot = self._buffer_pos % steps
        self._buffer_pos += 1
        if self._buffer[slot]["advantages"].device != self.device:  # restored from a checkpoint (loaded on CPU)
            self._buffer = [move_data_to_device(chunk, self.device) for chunk in self._buffer]
        mb = self._buffer[slot]
        self.last_batch_tokens = int(mb["prompt_mask"].sum() + mb["completion_mask"].sum())
        self.last_batch_samples = int(mb["completion_ids"].shape[0])
        with self.training_forward_context():
            logps, entropy = self.token_logps(self.model, mb, with_entropy=hp.log_entropy)
        accumulate = self.trainer.accumulate_grad_batches
        num_items, scale = None, 1.0
        if hp.loss_type == "dapo":
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
        )
        s = self.train_stats
        s[_key("loss")].update(loss.detach())
        s[_key("clip_ratio")].update(stats["clip_ratio/region_mean"])
        s[_key("clip_ratio/low")].update(stats["clip_ratio/low_mean"])
        s[_key("clip_ratio/high")].update(stats["clip_ratio/high_mean"])
        if "kl" in stats:
            s[_key("kl")].update(stats["kl"])
        if entropy is not None:
            s[_key("entropy")].update(entropy)
        return self.add_router_aux_loss(loss * scale)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
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
            rollout = self.generate(batch, self.hparams.num_generations)
        last_samples = self.last_samples
        self.score(rollout, self.eval_stats)
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
                                         "ranks": gather_per_rank(self._rank_state())}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("lightalign_grpo", {})
        self.generation_count = state.get("generation_count", 0)
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


def _key(name: str) -> str:
    return name.replace("/", "__").replace(".", "_")
