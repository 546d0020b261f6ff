"""``CriticFreeModule``: the online-RL methods whose baseline is the group's own rewards (GRPO, RLOO), not a value
model. They need only per-token log-probs, so they train in any layout of the micro-batch (padded, shared-prefix,
padding-free), and they follow TRL's rollout schedule: ``steps_per_generation`` micro-batches per rollout,
``num_iterations`` passes over it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from lightalign.modules.agent.episodes import ToolRollouts
from lightalign.modules.adaptations.layouts import packed_completion_batch, prompt_group_batch
from lightalign.modules.rollout.offpolicy.component import CloseSampler
from lightalign.modules.rollout.module import OnlineRLModule


class CriticFreeModule(OnlineRLModule):
    """Online RL with a group baseline (TRL's schedule and layouts).

    Args:
        steps_per_generation: training micro-batches one rollout is split into (default: the trainer's
            ``accumulate_grad_batches``, i.e. one rollout per optimizer step).
        num_iterations: how many times each rollout is trained on (PPO-style reuse, TRL's μ).
        prompt_sharing: train on each micro-batch in the shared-prefix layout: a prompt's tokens go through the
            model once for all of its completions in the micro-batch (one ``[prompt, completion_1, ...]``
            segment, position ids restarting after the prompt, a mask keeping completions apart), equal to the
            padded layout within float tolerance. Worth it for long prompts; the rollout is then shuffled by
            whole groups so a micro-batch holds whole groups. Needs ``sdpa`` or ``eager`` attention.
        pack_length: with ``prompt_sharing``, a micro-batch of ``T`` tokens is split into
            ``ceil(T / pack_length)`` rows of balanced length (``pack_rows``).
        padding_free: train on each micro-batch with no padding: every ``[prompt, completion]`` one after the
            other in one row, positions restarting at each, one attention call per sequence (``sdpa_varlen``);
            old and reference log-probs are computed the same way. Equal to the padded layout within float
            tolerance; refused at fit start on models that cannot run it exactly (measured on the model's class).
            Worth it when completion lengths vary (reasoning workloads). Not with ``prompt_sharing`` (pick one).
            TRL's GRPO has no such knob; the name is the one TRL's SFT and DPO use for the same idea.
        tools: tools the policy may call during a rollout: import paths of plain functions (``mypkg.tools:calc``)
            or callables; type hints and a docstring give each its JSON schema, which the chat template renders.
            Calls are parsed from the policy's turns in its template's format (the tokenizer's
            ``response_template``); results come back as ``tool`` messages whose tokens are not trained
            (``ToolRollouts``, docs/tools.md).
        environment_factory: an import path (or callable) building one environment per trajectory: ``reset(**row)``
            before it (may return text appended to the last user message), its public methods are tools,
            ``get_reward()`` (optional) scores the trajectory (a reward source named after the class, weight 1),
            ``close()`` (optional) once the rollout is scored or the run stops.
        max_tool_calling_iterations: tool-calling rounds per trajectory at most (None: until the policy answers
            without a call or ``max_completion_length``, which counts tool tokens too, is spent).
        tool_timeout: seconds one tool call may run; a call that takes longer, raises, names an unknown tool or
            passes wrong arguments becomes an ``error:`` tool message and counts in ``tools/failure_frequency``.
        response_template: how the tokenizer's assistant turns are parsed into ``content`` and ``tool_calls``
            (transformers' response-template dict), for a tokenizer that has none.
        max_staleness: asynchronous rollouts: with it > 0 a sampling process samples the next rollouts while the
            current one trains, on a copy of the policy's weights at most ``max_staleness`` optimizer steps old
            (as many rollouts ahead as fit: ``max_staleness`` // optimizer steps per rollout; at least one). Each
            rollout keeps its sampler's log-probs, and the loss is corrected by the importance-sampling ratio
            (``vllm_importance_sampling_*``). 0: each rollout is sampled by the policy that trains on it
            (synchronous). With ``use_vllm`` and ``vllm_mode: server`` the vLLM server samples instead, one
            rollout ahead (it holds one set of weights, pushed between rollouts). Seeded runs are reproducible and
            resume exactly (rollouts in flight are kept in the checkpoint); docs/async.md.
        async_sampler_threads: torch threads of the sampling process (the training process keeps the rest of
            its threads); default half of them. Only with ``max_staleness > 0`` and without vLLM.
        **kwargs: ``OnlineRLModule`` arguments (rewards, sampling, reference, vLLM and the importance-sampling
            correction ``vllm_importance_sampling_*``) and ``PolicyModule`` ones.
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        steps_per_generation: int | None = None,
        num_iterations: int = 1,
        prompt_sharing: bool = False,
        pack_length: int = 1024,
        padding_free: bool = False,
        tools: list[str | Callable] | None = None,
        environment_factory: str | Callable | None = None,
        max_tool_calling_iterations: int | None = None,
        tool_timeout: float | None = 60.0,
        response_template: dict[str, Any] | None = None,
        max_staleness: int = 0,
        async_sampler_threads: int | None = None,
        **kwargs: Any,
    ) -> None:
        if num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {num_iterations}.")
        if steps_per_generation is not None and steps_per_generation < 1:
            raise ValueError(f"steps_per_generation must be >= 1, got {steps_per_generation}.")
        if pack_length < 1:
            raise ValueError(f"pack_length must be >= 1, got {pack_length}.")
        if padding_free and prompt_sharing:
            raise ValueError("padding_free and prompt_sharing are two layouts of the training micro-batch; set one: "
                             "prompt_sharing for long prompts shared by many completions, padding_free for short "
                             "prompts with completions of varied length.")
        generation_batch_size = kwargs.get("generation_batch_size")
        if generation_batch_size is not None and steps_per_generation and generation_batch_size % steps_per_generation:
            raise ValueError(f"generation_batch_size ({generation_batch_size}) must split evenly into "
                             f"steps_per_generation ({steps_per_generation}) micro-batches: {generation_batch_size} / "
                             f"{steps_per_generation} is not an integer.")
        # read by OnlineRLModule.__init__ (the environment's reward source, the tool statistics)
        object.__setattr__(self, "tool_rollouts", ToolRollouts.build(
            tools, environment_factory, max_tool_calling_iterations, tool_timeout, response_template))
        # the off-policy component OnlineRLModule.__init__ builds samples ahead with these (checked there)
        object.__setattr__(self, "sampling_ahead", (max_staleness, async_sampler_threads))
        super().__init__(model_name_or_path, **kwargs)

    def configure_callbacks(self) -> list:
        callbacks = super().configure_callbacks()
        if self.hparams.max_staleness:
            callbacks.append(CloseSampler(self.off_policy))
        return callbacks

    def micro_batches_per_rollout(self) -> int:
        steps = self.hparams.steps_per_generation
        return steps or (self.trainer.accumulate_grad_batches if self._trainer is not None else 1)

    def passes(self) -> int:
        return self.hparams.num_iterations

    def micro_batch_layout(self, mb: dict[str, torch.Tensor], lengths: torch.Tensor) -> None:
        hp = self.hparams
        if hp.prompt_sharing:
            pad = self.tokenizer.pad_token_id
            mb["shared"] = prompt_group_batch(mb, pad if pad is not None else 0, hp.pack_length, lengths)
        elif hp.padding_free:
            mb["packed"] = packed_completion_batch(mb, lengths)

    def batch_layout(self) -> tuple[str, int | None]:
        _, longest = super().batch_layout()
        hp = self.hparams
        layout = "grpo_shared" if hp.prompt_sharing else "grpo_packed" if hp.padding_free else "grpo_padded"
        return layout, longest
