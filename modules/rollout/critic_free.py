"""``CriticFreeModule``: the online-RL methods whose baseline is the group's own rewards (GRPO, RLOO), not a value
model. They need only per-token log-probs, so they train in any layout of the micro-batch (padded, shared-prefix,
padding-free), and they follow TRL's rollout schedule: ``steps_per_generation`` micro-batches per rollout,
``num_iterations`` passes over it.
"""

from __future__ import annotations

import dataclasses

import torch

from lightalign.knobs import KnobGroup, knob, takes_knobs
from lightalign.modules.agent.episodes import ToolKnobs, ToolRollouts
from lightalign.modules.adaptations.layouts import packed_completion_batch, prompt_group_batch
from lightalign.modules.rollout.offpolicy.component import AsyncRolloutKnobs, CloseSampler
from lightalign.modules.rollout.module import OnlineRLModule


@dataclasses.dataclass(frozen=True)
class RolloutScheduleKnobs(KnobGroup):
    """TRL's rollout schedule: how a rollout is split into training steps, and how often it is trained on."""

    group = "schedule"
    steps_per_generation: int | None = knob(
        None, "training micro-batches one rollout is split into (default: the trainer's ``accumulate_grad_batches``, "
              "i.e. one rollout per optimizer step).")
    num_iterations: int = knob(1, "how many times each rollout is trained on (PPO-style reuse, TRL's μ).")

    def check(self) -> None:
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}.")
        if self.steps_per_generation is not None and self.steps_per_generation < 1:
            raise ValueError(f"steps_per_generation must be >= 1, got {self.steps_per_generation}.")


@dataclasses.dataclass(frozen=True)
class RolloutLayoutKnobs(KnobGroup):
    """The layout of a training micro-batch of a rollout (each equal to the padded one within float tolerance)."""

    group = "layout"
    prompt_sharing: bool = knob(
        False, "train on each micro-batch in the shared-prefix layout: a prompt's tokens go through the model once for "
               "all of its completions in the micro-batch (one ``[prompt, completion_1, ...]`` segment, position ids "
               "restarting after the prompt, a mask keeping completions apart), equal to the padded layout within "
               "float tolerance. Worth it for long prompts; the rollout is then shuffled by whole groups so a "
               "micro-batch holds whole groups. Needs ``sdpa`` or ``eager`` attention.")
    pack_length: int = knob(1024, "with ``prompt_sharing``, a micro-batch of ``T`` tokens is split into "
                                  "``ceil(T / pack_length)`` rows of balanced length (``prompt_group_batch``).")
    padding_free: bool = knob(
        False, "train on each micro-batch with no padding: every ``[prompt, completion]`` one after the other in one "
               "row, positions restarting at each, one attention call per sequence (``sdpa_varlen``); old and "
               "reference log-probs are computed the same way. Equal to the padded layout within float tolerance; "
               "refused at fit start on models that cannot run it exactly (measured on the model's class). Worth it "
               "when completion lengths vary (reasoning workloads). Not with ``prompt_sharing`` (pick one). TRL's GRPO "
               "has no such knob; the name is the one TRL's SFT and DPO use for the same idea.")

    def check(self) -> None:
        if self.pack_length < 1:
            raise ValueError(f"pack_length must be >= 1, got {self.pack_length}.")
        if self.padding_free and self.prompt_sharing:
            raise ValueError("padding_free and prompt_sharing are two layouts of the training micro-batch; set one: "
                             "prompt_sharing for long prompts shared by many completions, padding_free for short "
                             "prompts with completions of varied length.")


@takes_knobs(RolloutScheduleKnobs, RolloutLayoutKnobs, ToolKnobs, AsyncRolloutKnobs)
class CriticFreeModule(OnlineRLModule):
    """Online RL with a group baseline (TRL's schedule and layouts)."""

    def check_knob_combinations(self) -> None:
        super().check_knob_combinations()
        batch, steps = self.knobs.rollout.generation_batch_size, self.knobs.schedule.steps_per_generation
        if batch is not None and steps and batch % steps:
            raise ValueError(f"generation_batch_size ({batch}) must split evenly into steps_per_generation ({steps}) "
                             f"micro-batches: {batch} / {steps} is not an integer.")

    def build_tool_rollouts(self) -> ToolRollouts | None:
        if "tools" not in self.knobs:  # a method that drops ToolKnobs (``takes_knobs(without=...)``)
            return None
        tools = self.knobs.tools
        return ToolRollouts.build(tools.tools, tools.environment_factory, tools.max_tool_calling_iterations,
                                  tools.tool_timeout, tools.response_template)

    def sampling_ahead(self) -> tuple[int, int | None]:
        if "async_rollouts" not in self.knobs:  # a method that drops AsyncRolloutKnobs: synchronous
            return super().sampling_ahead()
        ahead = self.knobs.async_rollouts
        return ahead.max_staleness, ahead.async_sampler_threads

    def keeps_groups_whole(self) -> bool:
        return self.knobs.layout.prompt_sharing

    def configure_callbacks(self) -> list:
        callbacks = super().configure_callbacks()
        if self.off_policy.max_staleness:
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
