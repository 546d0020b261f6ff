"""``SamplingModule``: the base of the methods that train on completions their models sample (online RL: GRPO, RLOO,
PPO; distillation; online DPO).

The sampling knobs they share (TRL's names) have their one definition, validation (``SamplingConfig.check``, at
construction, before any model loads) and description here; a method declares its own ``max_completion_length`` and
``temperature`` (their defaults, and what its loss does with the temperature, are its own) and passes them on. The
``Sampling`` component built from them chooses and runs the samplers. Also shared: the refusal of a knob the method
does not have (naming TRL's equivalent), and the statistics logged per optimizer step and per validation
(``train_stats`` / ``eval_stats``, ``StatMetrics`` the method builds).
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

import torch

from lightalign.modules.sampling.config import SamplingConfig
from lightalign.modules.sampling.vllm import check_vllm_knobs
from lightalign.modules.sampling.component import Sampling
from lightalign.modules.training.policy import PolicyModule
from lightalign.modules.training.stat_metrics import loggers_write_this_step, read_every_step


class SamplingModule(PolicyModule):
    """A method that samples completions from its models.

    Args:
        top_p: nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p`` (1.0: off).
        top_k: keep the ``top_k`` most likely tokens (None: off).
        min_p: keep tokens whose probability is at least ``min_p`` times the most likely one's (None: off).
        repetition_penalty: ``generate``'s penalty on tokens already in the sequence (1.0: off).
        generation_kwargs: more ``generate`` arguments (``GenerationConfig`` fields such as ``suppress_tokens``,
            ``no_repeat_ngram_size``); the ones the sampling sets itself (``max_new_tokens``,
            ``num_return_sequences``, ``temperature``, ``top_p`` ...) are refused naming the knob to use. (TRL lets
            them override its knobs.)
        generation_backend: the sampler (``SAMPLERS``, by name): ``generate`` (``model.generate``; any knob),
            ``continuous`` (transformers' continuous batching, paged KV cache: finished completions leave the batch;
            refuses ``repetition_penalty``, ``generation_kwargs`` and online RL's ``cache_implementation``),
            ``static`` (static KV cache, compiled decode step) or ``compact`` (lightalign's loop: finished
            completions leave the batch; refuses ``generation_kwargs``, ``cache_implementation``; one process).
            Unset: ``compact`` on a CPU (measured fastest there, docs/performance.md), ``generate`` elsewhere (GPUs
            not measured), and ``generate`` whenever ``compact`` cannot serve: a knob only ``generate`` honours,
            several processes, a model without a plain KV cache, or greedy tokens that differ from ``generate``'s on
            the model's probe (``adaptations.check_layout``). Decided at fit start for each model that samples (the
            policy; a ``seq_kd`` teacher separately), and the fit-start line says which and why. An asked backend
            that the probe measures not exact is refused.
        use_vllm: sample with vLLM on a GPU instead (TRL's names and defaults for every ``vllm_*`` knob;
            ``VLLMRollouts``, docs/vllm.md): the completions of the model being trained (the policy, the
            student), its weights pushed to the engine at fit start and after every optimizer step; a ``seq_kd``
            teacher's through an engine of its own, given its weights once. Refused without CUDA, and with
            ``generation_backend``.
        vllm_mode: ``colocate`` (a ``vllm.LLM`` inside each training process, on its GPU) or ``server`` (a
            separate ``vllm serve``).
        vllm_server_base_url: server mode: the server's URL (e.g. ``http://10.0.0.2:8000``); default
            ``http://{vllm_server_host}:{vllm_server_port}``.
        vllm_server_host: server mode: the server's host.
        vllm_server_port: server mode: the server's port.
        vllm_server_timeout: server mode: seconds to wait for each HTTP request.
        vllm_weight_sync_timeout: server mode: seconds a weight push (and the weight-transfer set-up) may take
            before the run stops with an error naming the server, instead of hanging (TRL's async GRPO:
            ``weight_sync_timeout``).
        vllm_group_port: server mode: the port of the NCCL weight-transfer group.
        vllm_gpu_memory_utilization: colocate mode: the share of the GPU each vLLM engine takes (weights and KV
            cache). Default (null): the method's TRL default, 0.3 (GRPO, RLOO, PPO, distillation) or 0.55 (online
            DPO).
        vllm_tensor_parallel_size: colocate mode: only 1 is built; larger: server mode with
            ``vllm serve --tensor-parallel-size N``.
        vllm_max_model_length: colocate mode: vLLM's ``max_model_len`` (default: the model's).
        vllm_enable_sleep_mode: colocate mode: vLLM releases its memory between samplings.
        vllm_model_impl: colocate mode: ``vllm`` or ``transformers`` model code inside vLLM.
        **kwargs: ``PolicyModule`` arguments (model, LoRA, optimizer, schedule).
    """

    knob_equivalents: dict[str, str] = {}  # TRL's (or a sibling method's) name -> this method's knob for the idea
    progress_stats: tuple[str, ...] = ()  # the statistics shown in the progress bar
    # SamplingConfig knobs a method declares beyond the shared ones (online RL's prefill and cache knobs), set by its
    # __init__ before this one runs
    sampling_extras: dict[str, Any] = {"share_prefill": False}
    vllm_gpu_memory_utilization_default = 0.3  # TRL's for the method (GRPOConfig, DistillationConfig)
    train_stats: torch.nn.ModuleDict
    eval_stats: torch.nn.ModuleDict

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        max_completion_length: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        generation_kwargs: dict[str, Any] | None = None,
        generation_backend: Literal["generate", "continuous", "static", "compact"] | None = None,
        use_vllm: bool = False,
        vllm_mode: Literal["colocate", "server"] = "colocate",
        vllm_server_base_url: str | None = None,
        vllm_server_host: str = "0.0.0.0",
        vllm_server_port: int = 8000,
        vllm_server_timeout: float = 240.0,
        vllm_weight_sync_timeout: float = 1800.0,
        vllm_group_port: int = 51216,
        vllm_gpu_memory_utilization: float | None = None,
        vllm_tensor_parallel_size: int = 1,
        vllm_max_model_length: int | None = None,
        vllm_enable_sleep_mode: bool = False,
        vllm_model_impl: Literal["vllm", "transformers"] = "vllm",
        **kwargs: Any,
    ) -> None:
        config = SamplingConfig.from_knobs(
            max_completion_length=max_completion_length, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, repetition_penalty=repetition_penalty, generation_kwargs=generation_kwargs,
            generation_backend=generation_backend, **self.sampling_extras)
        check_vllm_knobs(generation_kwargs=generation_kwargs, cache_implementation=config.cache_implementation,
                         **{k: v for k, v in locals().items() if k.startswith(("vllm_", "use_vllm"))})
        if use_vllm and config.backend is not None:
            raise ValueError("use_vllm samples with vLLM; generation_backend / use_transformers_continuous_batching "
                             "pick a transformers backend instead: set only one of them.")
        super().__init__(model_name_or_path, **kwargs)
        self.sampling = Sampling(config)
        self.tokenizer: Any = None  # the datamodule's, at setup

    # the vllm_* knobs declared above act only with use_vllm (the model card leaves them out when it is off)
    switched_knobs = {**PolicyModule.switched_knobs,
                      "use_vllm": tuple(n for n in inspect.signature(__init__).parameters if n.startswith("vllm_"))}

    @classmethod
    def refuse_unknown_knobs(cls, kwargs: dict[str, Any]) -> None:
        """A ``TypeError`` naming the first knob in ``kwargs`` neither this class nor ``PolicyModule`` takes, with
        the method's knob for the same idea (``knob_equivalents``) or the methods that take it."""
        accepted = {*inspect.signature(PolicyModule.__init__).parameters,
                    *inspect.signature(SamplingModule.__init__).parameters}
        unknown = sorted(set(kwargs) - accepted)
        if not unknown:
            return
        knob, name = unknown[0], cls.__name__
        instead = cls.knob_equivalents.get(knob)
        elsewhere = [] if instead else cls.methods_with_knob(knob)
        raise TypeError(f"{name} has no knob {knob!r}" + (f"; its {instead} is the same idea" if instead else "")
                        + (f"; {' and '.join(elsewhere)} take it" if elsewhere else "")
                        + f" (`lightalign fit --model.help {name}` lists its knobs).")

    def vllm_models(self) -> list[tuple[str, torch.nn.Module, str | None, bool]]:
        """With ``use_vllm``: who samples through an engine of its own, as ``(who, model, model folder, follows
        training)``; a model that follows training has its weights pushed after every optimizer step, the others
        once at fit start. Default: the policy."""
        return [("policy", self.model, self.model_name_or_path, True)]

    @classmethod
    def methods_with_knob(cls, knob: str) -> list[str]:
        """Sibling methods that declare ``knob`` (named in the refusal; default: none named)."""
        return []

    # ------------------------------------------------------------------------------------- hooks
    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None)
        self.tokenizer = getattr(datamodule, "tokenizer", None)
        if stage == "fit" and not hasattr(datamodule, "configure_rollout"):
            raise TypeError(f"{type(self).__name__} trains on PromptDataModule batches; got {type(datamodule).__name__}.")
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
        return "grpo_padded", None if prompt is None else prompt + self.hparams.max_completion_length

    def configure_callbacks(self) -> list:
        callbacks = super().configure_callbacks()
        if self.hparams.get("use_vllm"):  # the engines, their weight pushes, their samplers (VLLMRollouts)
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
