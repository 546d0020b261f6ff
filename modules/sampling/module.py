"""``SamplingModule``: the base of the methods that train on completions their models sample (online RL: GRPO, RLOO,
PPO; distillation; online DPO).

The sampling knobs they share (TRL's names) are the groups ``SamplingKnobs`` and ``VLLMKnobs``, checked together by
``check_knob_combinations`` at construction, before any model loads; a method states its own defaults of
``max_completion_length`` and ``temperature`` (what its loss does with the temperature is its own). The ``Sampling``
component built from them chooses and runs the samplers. Also shared: the refusal of a knob the method
does not have (naming TRL's equivalent), and the statistics logged per optimizer step and per validation
(``train_stats`` / ``eval_stats``, ``StatMetrics`` the method builds).
"""

from __future__ import annotations

from typing import Any

import torch

from lightalign.knobs import takes_knobs
from lightalign.modules.sampling.config import SamplingConfig, SamplingKnobs
from lightalign.modules.sampling.vllm import VLLMKnobs, check_vllm_knobs
from lightalign.modules.sampling.component import Sampling
from lightalign.modules.training.policy import PolicyModule
from lightalign.modules.training.stat_metrics import loggers_write_this_step, read_every_step

@takes_knobs(SamplingKnobs, VLLMKnobs)
class SamplingModule(PolicyModule):
    """A method that samples completions from its models (its sampling knobs: ``SamplingKnobs``, ``VLLMKnobs``)."""

    progress_stats: tuple[str, ...] = ()  # the statistics shown in the progress bar
    vllm_gpu_memory_utilization_default = 0.3  # TRL's for the method (GRPOConfig, DistillationConfig)
    train_stats: torch.nn.ModuleDict
    eval_stats: torch.nn.ModuleDict
    # the vllm_* knobs act only with use_vllm (the model card leaves them out when it is off)
    switched_knobs = {**PolicyModule.switched_knobs,
                      "use_vllm": tuple(n for n in VLLMKnobs.knob_names() if n.startswith("vllm_"))}

    def sampling_config(self) -> SamplingConfig:
        """The sampling knobs of the method's groups as one checked ``SamplingConfig``."""
        return SamplingConfig.from_groups(self.knobs.sampling)

    def check_knob_combinations(self) -> None:
        super().check_knob_combinations()
        config = self.sampling_config()
        check_vllm_knobs(generation_kwargs=config.generation_kwargs, cache_implementation=config.cache_implementation,
                         **self.knobs.vllm.values())
        if self.knobs.vllm.use_vllm and config.backend is not None:
            raise ValueError("use_vllm samples with vLLM; generation_backend / use_transformers_continuous_batching "
                             "pick a transformers backend instead: set only one of them.")

    def compose(self) -> None:
        super().compose()
        self.sampling = Sampling(self.sampling_config())
        self.tokenizer: Any = None  # the datamodule's, at setup

    def vllm_models(self) -> list[tuple[str, torch.nn.Module, str | None, bool]]:
        """With ``use_vllm``: who samples through an engine of its own, as ``(who, model, model folder, follows
        training)``; a model that follows training has its weights pushed after every optimizer step, the others
        once at fit start. Default: the policy."""
        return [("policy", self.model, self.model_name_or_path, True)]

    # ------------------------------------------------------------------------------------- hooks
    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None)
        self.tokenizer = getattr(datamodule, "tokenizer", None)
        if stage == "fit" and not hasattr(datamodule, "configure_rollout"):
            raise TypeError(f"{type(self).__name__} trains on PromptDataModule batches; got {type(datamodule).__name__}.")
        if stage == "fit" and getattr(datamodule, "has_images", False):
            from lightalign.modules.sampling.image_prompts import check_image_prompts

            check_image_prompts(self)  # what is not exact with images, refused before any rollout
            self.sampling.images = True  # the sampler is chosen for image prompts (choose_sampler)
        split = getattr(datamodule, "conversation_rows", None)
        if stage == "fit" and split:
            from lightning.pytorch.utilities import rank_zero_info

            from lightalign.datamodules.prompt import conversation_split_note

            rank_zero_info(conversation_split_note(self.method_name or type(self).__name__, split,
                                                   self.data_completion_use()))

    def data_completion_use(self) -> str:
        """What this method does with the last assistant message of a conversation row (``PromptDataModule`` splits
        ``messages`` rows into a prompt and that message, the ``completion`` column): the end of the fit-start note."""
        rewarded = " (the reward functions still receive it, as their `completion` argument)" \
            if getattr(self, "reward_funcs", None) else ""
        return f"is dropped for online sampling: the policy samples its own completions{rewarded}"

    def batch_layout(self) -> tuple[str, int | None]:
        """Padded ``[prompt, completion]`` rows, the longest ``max_prompt_length + max_completion_length``."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        prompt = getattr(datamodule, "max_prompt_length", None)
        return "grpo_padded", None if prompt is None else prompt + self.knobs.sampling.max_completion_length

    def configure_callbacks(self) -> list:
        callbacks = super().configure_callbacks()
        if self.knobs.vllm.use_vllm:  # the engines, their weight pushes, their samplers (VLLMRollouts)
            from lightalign.modules.sampling.vllm_engines import VLLMRollouts

            callbacks.append(VLLMRollouts())
        return callbacks

    def on_fit_start(self) -> None:
        self.sampling.reset()  # the samplers are decided again (fit_start_notes): the models may have changed
        super().on_fit_start()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        self.before_step_stats()
        only = None if loggers_write_this_step(self.trainer) else read_every_step(self.trainer, self)
        self.train_stats.log(self, "train", self.progress_stats, only)  # the others on the loggers' steps

    def before_step_stats(self) -> None:
        """The method's last statistics of an optimizer step, before they are logged."""

    def on_validation_epoch_end(self) -> None:
        self.eval_stats.log(self, "val", self.progress_stats)
        self.log_eval_metrics("val")
