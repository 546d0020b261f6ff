"""Completions sampled by vLLM (``use_vllm``), for GPU users: a colocated ``vllm.LLM`` in the training process, or a
``vllm serve`` server reached over HTTP, with the trained model's weights pushed to the engine after each optimizer
step. Every sampling method takes it (``SamplingModule``: GRPO, RLOO, PPO, distillation, online DPO).

Knob names and defaults are TRL 1.16's (``GRPOConfig``, ``DistillationConfig``, ``OnlineDPOConfig``): ``use_vllm``,
``vllm_mode`` (``colocate`` | ``server``), ``vllm_server_base_url`` / ``vllm_server_host`` / ``vllm_server_port`` /
``vllm_server_timeout`` / ``vllm_group_port`` (server), ``vllm_gpu_memory_utilization`` /
``vllm_tensor_parallel_size`` / ``vllm_max_model_length`` / ``vllm_enable_sleep_mode`` / ``vllm_model_impl``
(colocate); ``vllm_weight_sync_timeout`` is TRL async GRPO's ``weight_sync_timeout``. The code is ours.

The pieces, each usable alone:

* ``VLLMConfig``: the engine knobs of a run, as one object (``SamplingModule`` declares and describes them once);
* ``check_vllm_knobs``: construction-time validation (a CPU machine is refused with the CPU alternative);
* ``vllm_sampling_params``: our sampling knobs as vLLM ``SamplingParams`` fields (a pure function);
* ``vllm_weight_name`` / ``vllm_weights``: the policy's parameters under the names vLLM's ``load_weights``
  expects (LoRA deltas added to their base weights, wrapper prefixes dropped, sharded parameters gathered);
* ``padded_completions``: the engine's completions (and their log-probs) as the ``Samples`` every sampler returns;
* ``ColocatedEngine`` / ``ServerEngine``: the two ways to reach vLLM; ``VLLMRollouts``: the Lightning callback
  that builds the engine at fit start, pushes weights after each optimizer step and hands the module the
  sampler its rollouts go through.

vllm is an optional extra (``pip install 'lightalign[vllm]'``), imported only when ``use_vllm`` is on. Nothing here
has run against a real engine on this project's CPU machines: see docs/vllm.md for what was and was not run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, fields
from typing import Any, Iterable, Iterator, Literal

import torch

from lightalign.knobs import KnobGroup, knob
from lightalign.modules.sampling.samplers import Samples

VLLM_MODES = ("colocate", "server")
VLLM_MODEL_IMPLS = ("vllm", "transformers")


@dataclass(frozen=True)
class VLLMConfig:
    """A run's vLLM engine knobs (``SamplingModule``'s ``use_vllm`` and ``vllm_*``; the module's hyper-parameters,
    read at fit start by ``VLLMConfig.of``). ``vllm_gpu_memory_utilization`` is resolved: the method's TRL default
    (``SamplingModule.vllm_gpu_memory_utilization_default``) when the knob is null."""

    use_vllm: bool  # no defaults here: the knobs' one definition is SamplingModule's signature
    vllm_mode: str
    vllm_server_base_url: str | None
    vllm_server_host: str
    vllm_server_port: int
    vllm_server_timeout: float
    vllm_weight_sync_timeout: float
    vllm_group_port: int
    vllm_gpu_memory_utilization: float
    vllm_tensor_parallel_size: int
    vllm_max_model_length: int | None
    vllm_enable_sleep_mode: bool
    vllm_model_impl: str

    @classmethod
    def of(cls, module: Any) -> "VLLMConfig":
        """The knobs of ``module`` (its hyper-parameters), the memory share resolved to the method's default."""
        hp = module.hparams
        knobs = {f.name: hp[f.name] for f in fields(cls)}
        if knobs.get("vllm_gpu_memory_utilization") is None:
            knobs["vllm_gpu_memory_utilization"] = type(module).vllm_gpu_memory_utilization_default
        return cls(**knobs)

    @property
    def server_url(self) -> str:
        return self.vllm_server_base_url or f"http://{self.vllm_server_host}:{self.vllm_server_port}"


# transformers GenerationConfig fields (our generation_kwargs) with a vLLM SamplingParams equivalent
GENERATION_KWARGS_TO_VLLM = {"min_new_tokens": "min_tokens", "presence_penalty": "presence_penalty",
                             "frequency_penalty": "frequency_penalty"}
INSTALL_HINT = "pip install 'lightalign[vllm]' (on a machine with a CUDA GPU)"


@dataclasses.dataclass(frozen=True)
class VLLMKnobs(KnobGroup):
    """Sampling with vLLM on a GPU (TRL's names and defaults); checked with the sampling knobs they combine with by
    ``check_vllm_knobs``."""

    group = "vllm"
    use_vllm: bool = knob(
        False, "sample with vLLM on a GPU instead (TRL's names and defaults for every ``vllm_*`` knob; docs/vllm.md): "
               "the completions of the model being trained (the policy, the student), its weights pushed to the "
               "engine at fit start and after every optimizer step; a ``seq_kd`` teacher's through an engine of its "
               "own, given its weights once. Refused without CUDA, and with ``generation_backend``.")
    vllm_mode: Literal["colocate", "server"] = knob(
        "colocate", "``colocate`` (a ``vllm.LLM`` inside each training process, on its GPU) or ``server`` (a "
                    "separate ``vllm serve``).")
    vllm_server_base_url: str | None = knob(None, "server mode: the server's URL (e.g. ``http://10.0.0.2:8000``); "
                                                  "default ``http://{vllm_server_host}:{vllm_server_port}``.")
    vllm_server_host: str = knob("0.0.0.0", "server mode: the server's host.")
    vllm_server_port: int = knob(8000, "server mode: the server's port.")
    vllm_server_timeout: float = knob(240.0, "server mode: seconds to wait for each HTTP request.")
    vllm_weight_sync_timeout: float = knob(
        1800.0, "server mode: seconds a weight push (and the weight-transfer set-up) may take before the run stops "
                "with an error naming the server, instead of hanging (TRL's async GRPO: ``weight_sync_timeout``).")
    vllm_group_port: int = knob(51216, "server mode: the port of the NCCL weight-transfer group.")
    vllm_gpu_memory_utilization: float | None = knob(
        None, "colocate mode: the share of the GPU each vLLM engine takes (weights and KV cache). Default (null): the "
              "method's TRL default, 0.3 (GRPO, RLOO, PPO, distillation) or 0.55 (online DPO).")
    vllm_tensor_parallel_size: int = knob(1, "colocate mode: only 1 is built; larger: server mode with "
                                             "``vllm serve --tensor-parallel-size N``.")
    vllm_max_model_length: int | None = knob(None, "colocate mode: vLLM's ``max_model_len`` (default: the model's).")
    vllm_enable_sleep_mode: bool = knob(False, "colocate mode: vLLM releases its memory between samplings.")
    vllm_model_impl: Literal["vllm", "transformers"] = knob("vllm", "colocate mode: ``vllm`` or ``transformers`` "
                                                                    "model code inside vLLM.")


def check_vllm_knobs(use_vllm: bool = False, vllm_mode: str = "colocate", vllm_model_impl: str = "vllm",
                     vllm_gpu_memory_utilization: float | None = 0.3, vllm_tensor_parallel_size: int = 1,
                     vllm_max_model_length: int | None = None, vllm_server_port: int = 8000,
                     vllm_group_port: int = 51216, vllm_server_timeout: float = 240.0,
                     vllm_weight_sync_timeout: float = 1800.0,
                     generation_kwargs: dict[str, Any] | None = None, cache_implementation: str | None = None,
                     cuda_available: bool | None = None, **_: Any) -> None:
    """The vLLM knobs of a sampling method (``SamplingModule``), checked at construction (before any model is
    loaded). ``vllm_gpu_memory_utilization`` None: the method's default."""
    if vllm_mode not in VLLM_MODES:
        raise ValueError(f"vllm_mode={vllm_mode!r} is unknown; use one of {list(VLLM_MODES)}.")
    if vllm_model_impl not in VLLM_MODEL_IMPLS:
        raise ValueError(f"vllm_model_impl={vllm_model_impl!r} is unknown; use one of {list(VLLM_MODEL_IMPLS)}.")
    if vllm_gpu_memory_utilization is not None and not 0.0 < vllm_gpu_memory_utilization <= 1.0:
        raise ValueError(f"vllm_gpu_memory_utilization must be in (0, 1], got {vllm_gpu_memory_utilization}.")
    if vllm_tensor_parallel_size < 1:
        raise ValueError(f"vllm_tensor_parallel_size must be >= 1, got {vllm_tensor_parallel_size}.")
    if vllm_max_model_length is not None and vllm_max_model_length < 1:
        raise ValueError(f"vllm_max_model_length must be >= 1 or null, got {vllm_max_model_length}.")
    for name, port in (("vllm_server_port", vllm_server_port), ("vllm_group_port", vllm_group_port)):
        if not 0 < int(port) < 65536:
            raise ValueError(f"{name} must be a TCP port (1-65535), got {port}.")
    if vllm_server_timeout < 0:
        raise ValueError(f"vllm_server_timeout must be >= 0 seconds, got {vllm_server_timeout}.")
    if not vllm_weight_sync_timeout > 0:
        raise ValueError(f"vllm_weight_sync_timeout must be > 0 seconds, got {vllm_weight_sync_timeout}.")
    if not use_vllm:
        return
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not cuda:
        raise ValueError("use_vllm: true needs a CUDA GPU (vLLM generates on GPUs) and this machine has none. On CPU "
                         "leave use_vllm: false: completions are sampled with transformers (generation_backend).")
    if vllm_mode == "colocate" and vllm_tensor_parallel_size > 1:
        raise ValueError(f"vllm_tensor_parallel_size={vllm_tensor_parallel_size} with vllm_mode: colocate is not built "
                         "in lightalign; use vllm_mode: server and start the server with "
                         f"`vllm serve <model> --tensor-parallel-size {vllm_tensor_parallel_size}`.")
    if cache_implementation is not None:
        raise ValueError(f"cache_implementation={cache_implementation!r} is a transformers generate() setting; vLLM "
                         "manages its own paged KV cache: unset it with use_vllm: true.")
    unknown = sorted(set(generation_kwargs or {}) - set(GENERATION_KWARGS_TO_VLLM))
    if unknown:
        raise ValueError(f"generation_kwargs {unknown} have no vLLM equivalent lightalign maps; with use_vllm: true "
                         f"generation_kwargs may hold {sorted(GENERATION_KWARGS_TO_VLLM)}.")
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"use_vllm: true needs vLLM, which is not installed: {INSTALL_HINT}.")


def vllm_sampling_params(*, num_generations: int, temperature: float, top_p: float, top_k: int | None,
                         min_p: float | None, repetition_penalty: float, max_completion_length: int,
                         eos_token_ids: Iterable[int], generation_kwargs: dict[str, Any] | None = None,
                         seed: int | None = None, logprobs: bool = False) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields sampling what our knobs ask ``generate`` for: ``num_generations`` samples
    per prompt, the same temperature / top_p / top_k (None or 0: off) / min_p (None: off) / repetition penalty,
    at most ``max_completion_length`` tokens, stopping at every EOS id of the model and tokenizer (the EOS token is
    kept in the completion, as ``generate`` keeps it), token ids returned as they are (no detokenisation needed).
    ``logprobs``: also the sampled token's log-prob at each position (vLLM's ``logprobs=0``: no alternatives); they
    are the sampling distribution's only when the engine runs with ``logprobs_mode="processed_logprobs"``."""
    params = {
        "n": int(num_generations), "temperature": float(temperature), "top_p": float(top_p),
        "top_k": int(top_k or 0), "min_p": float(min_p or 0.0), "repetition_penalty": float(repetition_penalty),
        "max_tokens": int(max_completion_length), "stop_token_ids": sorted({int(i) for i in eos_token_ids}),
        "ignore_eos": False, "skip_special_tokens": False, "detokenize": False,
    }
    for key, value in (generation_kwargs or {}).items():
        if key not in GENERATION_KWARGS_TO_VLLM:
            raise ValueError(f"generation_kwargs key {key!r} has no vLLM equivalent; mapped: "
                             f"{sorted(GENERATION_KWARGS_TO_VLLM)}.")
        params[GENERATION_KWARGS_TO_VLLM[key]] = value
    if seed is not None:
        params["seed"] = int(seed)
    if logprobs:
        params["logprobs"] = 0
    return params


# ------------------------------------------------------------------------------------------------ weights
# wrappers' own name segments: torch.compile, activation checkpointing, FSDP (v1)
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def vllm_weight_name(name: str, peft: bool = False) -> str | None:
    """A policy parameter's name as vLLM's ``load_weights`` expects it (the Hugging Face checkpoint name), or None
    for parameters vLLM does not hold (LoRA factors, the original copy of a ``modules_to_save`` module).

    ``peft``: the policy is a PEFT model (names under ``base_model.model.``, adapted layers under ``base_layer``)."""
    parts = [part for part in name.split(".") if part not in _WRAPPER_SEGMENTS]
    if parts and parts[0] == "module":  # DistributedDataParallel's wrapper
        parts = parts[1:]
    name = ".".join(parts)
    if peft:
        if ".lora_" in name or "original_module" in name:
            return None
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        name = name.replace(".modules_to_save.default", "")
    return name


def vllm_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under vLLM's names, one tensor at a time, detached. A LoRA layer's base weight is sent
    with its active adapters' deltas added (computed apart: the policy's own weights are never merged in place,
    which would round them a little at every push); FSDP2 / ZeRO-3 parameters are gathered, so every rank must
    iterate."""
    from lightalign.modules.training.lora import is_peft_model
    from lightalign.strategies.sharding import generation_context

    peft = is_peft_model(model)
    lora_layers = {f"{name}.base_layer.weight": module for name, module in model.named_modules()
                   if peft and hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")}
    with generation_context(model), torch.no_grad():
        for name, param in model.named_parameters():
            target = vllm_weight_name(name, peft=peft)
            if target is None:
                continue
            tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
            layer = lora_layers.get(name)
            if layer is not None and not getattr(layer, "merged", False):
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
                        tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
            yield target, tensor.detach()


# ------------------------------------------------------------------------------------------------ rollouts
def padded_completions(completions: list[list[int]], prompts: int, num_generations: int, pad_token_id: int | None,
                       device: torch.device | None = None, logps: list[list[float]] | None = None) -> Samples:
    """An engine's completions (``num_generations`` lists of token ids per prompt, prompt-major) as the ``Samples``
    every sampler returns: ids ``[prompts * num_generations, longest]`` right-padded
    with ``pad_token_id``; with ``logps`` (each completion's per-token log-probs, NaN where the engine scored none)
    those as float32 ``[rows, longest]``, 0 after each completion's end; and each one's length (a completion can
    end without EOS before the longest: at the engine's context length)."""
    if len(completions) != prompts * num_generations:
        raise ValueError(f"the engine returned {len(completions)} completions for {prompts} prompts x "
                         f"{num_generations} generations.")
    if logps is not None and [len(row) for row in logps] != [len(ids) for ids in completions]:
        raise ValueError("the engine's log-probs do not align with its completions: one per sampled token of each "
                         f"completion expected, got {[len(row) for row in logps]} for completions of "
                         f"{[len(ids) for ids in completions]} tokens.")
    pad = pad_token_id if pad_token_id is not None else 0
    width = max(1, max(len(ids) for ids in completions))
    out = torch.full((len(completions), width), pad, dtype=torch.long)
    for row, ids in enumerate(completions):
        out[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    lengths = torch.tensor([len(ids) for ids in completions], dtype=torch.long)
    out_logps = None
    if logps is not None:
        out_logps = torch.zeros((len(completions), width), dtype=torch.float32)
        for row, values in enumerate(logps):
            out_logps[row, : len(values)] = torch.tensor(list(values), dtype=torch.float32)
    if device is not None:
        out, lengths = out.to(device), lengths.to(device)
        out_logps = None if out_logps is None else out_logps.to(device)
    return Samples(out, out_logps, lengths)
