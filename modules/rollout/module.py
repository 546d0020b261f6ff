"""``OnlineRLModule``: the online-RL loop every method on it shares (GRPO, RLOO, PPO), as explicit stages.

Per rollout (the first ``training_step`` of each): **sample** ``num_generations`` completions per prompt on the
run's sampler (``Sampling``) -> **score** them with the reward functions (``score_rollout``) -> **split** the rollout
into the micro-batches of ``training_step`` (``buffer.split_rollout``, with the method's training layout) ->
**log-probs** of the sampling policy (when the rollout is trained on by an updated policy) and of the reference
(``Reference``) -> **advantages**, the method's own stage (``rollout_advantages``) -> **buffer**. Every
``training_step`` then takes the next micro-batch (``next_micro_batch``) and computes the method's loss.

A method declares its own knobs and objective: ``micro_batches_per_rollout`` and ``passes`` (its rollout schedule),
``uses_reference`` (a reference model is built and its log-probs computed), ``rollout_advantages`` and
``training_step``. Everything here is described once, in this class's docstring.
"""

from __future__ import annotations

from typing import Any

import torch

from lightalign.datamodules.image_prompts import prompt_image_entries
from lightalign.knobs import takes_knobs
from lightalign.modules.agent.environments import closing_environments
from lightalign.modules.agent.episodes import TOOL_STATS, ToolRollouts
from lightalign.modules.sampling.config import RolloutSamplingKnobs, SamplingConfig
from lightalign.modules.rollout.offpolicy.component import OffPolicyRollouts
from lightalign.modules.losses.importance_sampling import ImportanceSamplingKnobs
from lightalign.modules.reference.component import Reference, ReferenceKnobs
from lightalign.modules.reference.bema import BEMAKnobs
from lightalign.modules.reference.sync import ReferenceSyncKnobs, quantized_reference
from lightalign.modules.rollout.buffer import RolloutBuffer, RolloutKnobs, check_generation_arithmetic, split_rollout
from lightalign.modules.rollout.scoring import fallback_stat, score_rollout
from lightalign.modules.rollout.state import load_rollout_state, save_rollout_state
from lightalign.modules.sampling.module import SamplingModule
from lightalign.modules.training.stat_metrics import StatMetrics
from lightalign.rewards import reward_func_names
from lightalign.rewards.runner import RewardKnobs

ROLLOUT_STATS = ("loss", "entropy", "reward/mean", "reward/std", "completions/mean_length", "completions/clipped_ratio")


@takes_knobs(RewardKnobs, RolloutKnobs, RolloutSamplingKnobs, ReferenceKnobs, ReferenceSyncKnobs, BEMAKnobs, ImportanceSamplingKnobs)
class OnlineRLModule(SamplingModule):
    """The online-RL loop on the prompt batches of ``PromptDataModule`` (TRL's knob names and defaults)."""

    min_generations = 2  # completions per prompt a method's advantage needs
    knob_equivalents: dict[str, str] = {}  # a sibling method's knob -> this method's knob for the same idea
    method_stats: tuple[str, ...] = ()  # the method's own logged statistics, beside ROLLOUT_STATS
    progress_stats = ("reward/mean",)
    _unregistered_attributes = SamplingModule._unregistered_attributes | {"reward_funcs"}
    tool_rollouts: ToolRollouts | None = None  # multi-turn tool rollouts (``build_tool_rollouts``)
    off_policy: OffPolicyRollouts  # rollouts not sampled by the policy (vLLM, or a sampler ahead), their correction

    def sampling_config(self) -> SamplingConfig:
        return SamplingConfig.from_groups(self.knobs.sampling, self.knobs.rollout_sampling)

    def check_knob_combinations(self) -> None:
        super().check_knob_combinations()
        num_generations = self.knobs.rollout.num_generations
        if num_generations < self.min_generations:
            raise ValueError(f"{type(self).__name__} needs num_generations >= {self.min_generations} "
                             f"({self.group_needs}), got {num_generations}.")

    def reference_sync_blocker(self) -> str | None:
        if self.uses_reference_model and not self.uses_reference:
            coef = self.knob_equivalents.get("beta", "beta")
            return f"{coef}=0 builds no reference model; set {coef} > 0 to have one"
        return super().reference_sync_blocker() or quantized_reference(self.knobs.reference.ref_model_init_kwargs)

    def compose(self) -> None:
        super().compose()
        rewards = self.knobs.rewards
        self.tool_rollouts = self.build_tool_rollouts()
        sources = self.tool_rollouts.reward_sources(rewards.reward_timeout) if self.tool_rollouts is not None else []
        if rewards.reward_funcs in (None, [], ()) and not sources:  # an empty list scores nothing either
            raise ValueError(f"{type(self).__name__} needs reward_funcs: callables or import paths of fn(prompts, "
                             "completions, **columns) (or an environment_factory whose environments define "
                             "get_reward).")
        funcs = rewards.resolved()
        # an environment's reward: weight 1
        self.reward_weights = [*(rewards.reward_weights or [1.0] * len(funcs)), *([1.0] * len(sources))]
        self.reward_funcs = [*funcs, *sources]
        self.reward_names = reward_func_names(self.reward_funcs)
        correction = self.knobs.importance_sampling
        self.off_policy = OffPolicyRollouts(
            *self.sampling_ahead(), correction.vllm_importance_sampling_correction,
            correction.vllm_importance_sampling_mode, correction.vllm_importance_sampling_clip_min,
            correction.vllm_importance_sampling_clip_max)
        reference = self.knobs.reference
        self.reference = Reference(reference.ref_model_name_or_path, reference.ref_model_init_kwargs,
                                   num_shared_layers=self.shared_layers())
        self.generation_count = 0
        self.rollout_buffer = RolloutBuffer()
        self.last_samples: list[dict[str, Any]] = []
        fallback = rewards.reward_fallback_value is not None
        self.stat_names = [*ROLLOUT_STATS, *self.method_stats, *(f"reward/{n}" for n in self.reward_names),
                           *(fallback_stat(n) for n in self.reward_names if fallback),
                           *(TOOL_STATS if self.tool_rollouts is not None else ()),
                           *self.off_policy.stat_names(self.knobs.vllm.use_vllm)]
        self.reward_fallbacks_warned: set[str] = set()  # functions whose first fallback substitution was warned
        self.train_stats = StatMetrics(self.stat_names, nan_strategy="ignore")
        self.eval_stats = StatMetrics(self.stat_names, nan_strategy="ignore")

    def build_tool_rollouts(self) -> ToolRollouts | None:
        """Multi-turn tool rollouts, for a method that takes tools (default: single-turn rollouts)."""
        return None

    def sampling_ahead(self) -> tuple[int, int | None]:
        """``(max_staleness, async_sampler_threads)`` of a method that samples ahead (default: synchronous)."""
        return 0, None

    def keeps_groups_whole(self) -> bool:
        """Whether a micro-batch holds each prompt's completions together (a shared-prompt layout; default no)."""
        return False

    def shared_layers(self) -> int | None:
        """The policy layers the reference shares, for a method that takes ``num_shared_layers`` (default: none)."""
        return None

    # ------------------------------------------------------------------------------------- the method's part
    group_needs = "advantages compare completions of a group"


    @property
    def uses_reference(self) -> bool:
        """Whether the method's objective reads the reference model (its KL coefficient is > 0)."""
        raise NotImplementedError

    def micro_batches_per_rollout(self) -> int:
        """``training_step`` calls one pass over a rollout takes."""
        raise NotImplementedError

    def passes(self) -> int:
        """Passes over each rollout."""
        raise NotImplementedError

    def needs_old_logps(self) -> bool:
        """Whether the rollout stores the sampling policy's log-probs (default: when an updated policy trains on
        it)."""
        return self.reuses_rollout()

    def sampler_is_stale(self) -> bool:
        """Whether the rollouts are sampled by something other than the policy being trained (a sampler ahead on
        older weights, or vLLM): then their sampler's log-probs are kept and compared with the policy's."""
        return self.off_policy.sampler_is_stale(self)

    def rollout_advantages(self, chunks: list[dict[str, torch.Tensor]]) -> None:
        """The method's advantage stage: write ``advantages`` (and whatever its loss reads) into the micro-batches
        (``buffer.in_rollout_order`` / ``scatter_rows``)."""
        raise NotImplementedError

    def check_scores(self, per_func: torch.Tensor, total: torch.Tensor) -> None:
        """Refuse rewards the method cannot use (default: every score, None included, is usable)."""

    def micro_batch_layout(self, mb: dict[str, torch.Tensor], lengths: torch.Tensor) -> None:
        """Add the training layout's tensors to a micro-batch (default: the padded rows as they are)."""

    # ------------------------------------------------------------------------------------- shape
    @property
    def rollout_shape(self) -> tuple[int, int, int]:
        """(generation_batch_size, micro-batches per rollout, micro-batch size in completions), resolved."""
        steps = self.micro_batches_per_rollout()
        gen = self.hparams.generation_batch_size or self.hparams.num_generations * steps
        return gen, steps, gen // steps

    def reuses_rollout(self) -> bool:
        """Whether a rollout is trained on by an updated policy (several passes, or several optimizer steps)."""
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        return self.passes() > 1 or self.micro_batches_per_rollout() > accumulate

    # ------------------------------------------------------------------------------------- setup
    def setup(self, stage: str) -> None:
        super().setup(stage)  # the tokenizer; PromptDataModule batches
        if stage != "fit":
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        gen, steps, _ = self.rollout_shape
        check_generation_arithmetic(gen, self.hparams.num_generations, steps)
        if self.tool_rollouts is not None:
            self.tool_rollouts.check_setup(self.tokenizer, datamodule)
        self.off_policy.check_setup(self)
        datamodule.configure_rollout(gen // self.hparams.num_generations, steps * self.passes())

    def configure_model(self) -> None:
        super().configure_model()
        if self.uses_reference and self.ref_model is None:
            with torch.inference_mode(False):
                self.ref_model = self.reference.build(self.model, self.model_name_or_path, self.hparams.trust_remote_code)

    def on_fit_start(self) -> None:
        super().on_fit_start()  # the sampler decided again (fit_start_notes), the layout check, NEFTune when asked
        self.reference.move(self.ref_model, self.device, self.model)

    def fit_start_notes(self) -> list[str]:
        """The sampler, decided (and measured) here, before any rollout: an inexact asked backend or shared
        prefill is refused at fit start; with tools, the response template that reads the calls and how it was
        chosen."""
        ahead = self.off_policy.note(self)
        tools = getattr(self.tool_rollouts, "template_note", None)  # which response template reads the calls, how
        extra = [n for n in (ahead, tools) if n]
        if self.hparams.use_vllm:
            return extra
        self.sampling_backend()
        return [self.sampling_note, *extra]

    def largest_group(self) -> int:
        """The most completions per prompt the run samples (training or validation)."""
        hp = self.hparams
        return max(hp.num_generations, hp.num_generations_eval or hp.num_generations)

    def sampling_backend(self) -> str:
        """The run's sampler, decided once per fit (``Sampling.backend``)."""
        return self.sampling.backend(self.model, largest_group=self.largest_group())

    @property
    def external_sampler(self) -> Any:
        """The policy's engine sampler (``use_vllm``: set by ``VLLMRollouts`` for the fit), else None."""
        return self.sampling.engines.get("policy")

    @property
    def sampling_note(self) -> str:
        return self.sampling.note()

    # ------------------------------------------------------------------------------------- stages
    @torch.no_grad()
    def generate(self, batch: dict[str, Any], num_generations: int, return_logprobs: bool = False) -> dict[str, Any]:
        """Sample ``num_generations`` completions per prompt on the run's sampler (the vLLM engine's with
        ``use_vllm``), through ``Sampling`` as every sampling method does."""
        if self.tool_rollouts is not None:  # multi-turn: tool calls and results between sampled turns
            datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
            return self.tool_rollouts.sample(
                self.model, self.tokenizer, batch, num_generations,
                backend=self.sampling.sampler(self.model, largest_group=self.largest_group()),
                sampling=self.sampling.sampling_kwargs(), return_logprobs=return_logprobs,
                max_prompt_length=getattr(datamodule, "max_prompt_length", None),
                chat_template_kwargs=getattr(datamodule, "chat_template_kwargs", None))
        return self.sampling.sample(self.model, self.tokenizer, batch, num_generations,
                                    largest_group=self.largest_group(), return_logprobs=return_logprobs)

    def sample_rollout(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This step's rollout: sampled now by the policy, or by the off-policy sampler (vLLM, ahead)."""
        return self.off_policy.sample(self, batch)

    def score(self, rollout: dict[str, Any], stats: torch.nn.ModuleDict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each function's rewards ``[N, F]`` and their weighted sum ``[N]`` (NaN: no function scored it), logged
        in ``stats``; the eval metrics see each scored completion's total while validating."""
        per_func, total = score_rollout(self, rollout, stats)
        self.check_scores(per_func, total)
        return per_func, total

    def token_logps(self, model: torch.nn.Module, mb: dict[str, Any], with_entropy: bool = False,
                    entropy_grad: bool = False):
        """Per-token log-probs of the completion tokens ``[B, T]`` and, ``with_entropy``, their per-token entropies
        ``[B, T]`` (0 under the completion mask; differentiable only with ``entropy_grad``)."""
        from lightalign.modules.training.rollout_forward import grpo_forward
        from lightalign.modules.losses.entropy import token_entropies
        from lightalign.modules.training.logprobs import scatter_to_sequences

        logps, logits, _ = grpo_forward(model, mb, self.logprob_temperature())
        if not with_entropy:
            return logps, None
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropies = token_entropies(logits)
        layout = mb.get("shared", mb.get("packed"))  # [targets] -> [B, T]
        if layout is not None:
            entropies = scatter_to_sequences(entropies, layout, *mb["completion_ids"].shape)[0]
        return logps, torch.where(mb["completion_mask"].bool(), entropies, torch.zeros_like(entropies))

    def logprob_temperature(self) -> float:
        """The temperature the policy's logits are divided by before the log-probs of its completions (default the
        sampling ``temperature``, as TRL's GRPO, RLOO and PPO; A*-PO's are the model's own, at 1)."""
        return self.hparams.temperature

    def reference_logps(self, mb: dict[str, Any]) -> torch.Tensor:
        with self.reference.model_for(self.ref_model, self.model) as ref:
            return self.token_logps(ref, mb)[0]

    def next_micro_batch(self, batch: dict[str, Any]) -> tuple[dict[str, torch.Tensor], int]:
        """The buffered micro-batch this training step trains on (a new rollout when the buffer is used up), and
        its slot in the rollout."""
        steps, passes = self.micro_batches_per_rollout(), self.passes()
        if self.rollout_buffer.used_up(steps, passes):
            self.rollout_buffer.fill(self._make_rollout(batch))
        elif self.rollout_buffer.starts_new_pass(steps, passes):
            self.on_new_pass(self.rollout_buffer)
        mb, slot = self.rollout_buffer.take(steps, self.device)
        self.last_batch_tokens = int(mb["prompt_mask"].sum() + mb["completion_mask"].sum())
        self.last_batch_samples = int(mb["completion_ids"].shape[0])
        return mb, slot

    def on_new_pass(self, buffer: RolloutBuffer) -> None:
        """Before a pass over the rollout other than the first (PPO deals new mini-batches here)."""

    @torch.no_grad()
    def _make_rollout(self, batch: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        hp = self.hparams
        gen, steps, _ = self.rollout_shape
        prompts_expected = gen // hp.num_generations
        if len(batch["prompts"]) != prompts_expected:
            raise ValueError(f"Expected {prompts_expected} prompts per rollout (generation_batch_size {gen} / "
                             f"num_generations {hp.num_generations}), got {len(batch['prompts'])}.")
        rollout = self.sample_rollout(batch)  # 1. sample
        self.generation_count += 1
        with closing_environments(rollout):
            per_func, total = self.score(rollout, self.train_stats)  # 2. score
        lengths = rollout["completion_mask"].sum(-1)  # tokens through the last EOS (tool results included)
        tensors = {k: rollout[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                           *(("sampling_logps",) if self.sampler_is_stale() else ()))}
        tensors.update(prompt_image_entries(rollout))  # the prompts' images (ImageInputs, token extras), per row
        if "tool_mask" in rollout:  # tool results: attended to, not trained on (nor in the KL)
            tensors["completion_attention_mask"] = rollout["completion_mask"]
            tensors["completion_mask"] = rollout["completion_mask"] * rollout["tool_mask"]
        if hp.mask_truncated_completions:
            tensors["completion_mask"] = tensors["completion_mask"] * (~rollout["truncated"]).long().unsqueeze(-1)
        tensors["rewards"], tensors["reward_parts"] = total, per_func.to(total.device)
        tensors["row"] = torch.arange(total.shape[0], device=total.device)  # the rollout order (groups)
        chunks = split_rollout(tensors, lengths, steps, hp.num_generations,  # 3. split, in the training layout
                               whole_groups=self.keeps_groups_whole())
        for mb in chunks:
            self.micro_batch_layout(mb, mb.pop("lengths"))
        needs_old = self.needs_old_logps()
        for mb in chunks:  # 4. log-probs of the sampling policy and the reference
            if needs_old:
                mb["old_logps"], _ = self.token_logps(self.model, mb)
            if self.uses_reference:
                mb["ref_logps"] = self.reference_logps(mb)
        self.rollout_advantages(chunks)  # 5. the method's advantages
        return chunks

    # ------------------------------------------------------------------------------------- logging
    def step_tokens(self, slot: int) -> torch.Tensor:
        """The completion tokens of this optimizer step's micro-batches, averaged over the ranks."""
        tokens = self.rollout_buffer.step_tokens(slot, self.trainer.accumulate_grad_batches)
        world = self.trainer.world_size
        if world > 1:
            tokens = self.trainer.strategy.reduce(tokens.float(), reduce_op="sum") / world
        return tokens

    # ------------------------------------------------------------------------------------- validation
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Sample ``num_generations_eval`` completions per validation prompt and score them (no loss).

        Sampling uses its own seeded stream, so validating does not change the training rollouts (and a run
        resumed from a checkpoint samples exactly what the uninterrupted run sampled)."""
        with self.sampling.validation_stream(self, batch_idx):
            rollout = self.generate(batch, self.hparams.num_generations_eval or self.hparams.num_generations)
        last_samples = self.last_samples
        with closing_environments(rollout):
            self.score(rollout, self.eval_stats)
        self.last_samples = last_samples  # the sample table shows training rollouts

    # ------------------------------------------------------------------------------------- state
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        save_rollout_state(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        load_rollout_state(self, checkpoint)

    def rank_state(self) -> dict[str, Any]:
        """This rank's rollout buffer (on the CPU) and position, the rollouts sampled ahead, the sample table of the
        rollout in training (``last_samples``), and the method's per-rank state."""
        state = self.rollout_buffer.state_dict()
        state.update(self.off_policy.state_dict())
        state["last_samples"] = list(self.last_samples)
        return state

    def load_rank_state(self, state: dict[str, Any]) -> None:
        """The method's per-rank state (beside the buffer)."""

    def method_state(self) -> dict[str, Any]:
        """The method's state shared by the ranks (the same on every rank)."""
        return {}

    def load_method_state(self, state: dict[str, Any]) -> None:
        pass
