"""The two ways lightalign reaches vLLM (``use_vllm``), and the callback that keeps the engine's weights the policy's.

* ``ColocatedEngine`` (``vllm_mode: colocate``): a ``vllm.LLM`` in each training process, sharing its GPU
  (``vllm_gpu_memory_utilization`` of it); weights go in with the engine's ``load_weights``.
* ``ServerEngine`` (``vllm_mode: server``): a separate ``VLLM_SERVER_DEV_MODE=1 vllm serve <model>
  --weight-transfer-config '{"backend": "nccl"}'`` (dev mode for ``/reset_prefix_cache``); completions come
  from its ``/v1/completions`` route (prompts as token ids, token ids back), weights go over vLLM's NCCL
  weight-transfer group (the trainer is rank 0, the server's workers follow).
  Every rank asks for its own prompts' completions; rank 0 alone pushes weights.
* ``VLLMRollouts``: a Lightning callback (``SamplingModule.configure_callbacks`` adds it when ``use_vllm`` is on):
  builds an engine per model that samples at fit start (the policy or student; a ``seq_kd`` teacher), pushes its
  weights then (and, for the model being trained, after every optimizer step), and hands the module's ``Sampling``
  component their samplers, which its completions are sampled through.

Both engines' ``generate(prompts, params) -> (completions, logps)``: the token ids of ``params["n"]`` completions
per prompt (prompt-major) and, when ``params`` asks for ``logprobs``, each sampled token's log-prob in the
distribution it was sampled from (vLLM's ``processed_logprobs``: after temperature, top-k/top-p/min-p and penalties;
NaN where vLLM gave none, as TRL keeps it), else None. The colocated engine is built in that mode; a server must be
started with ``--logprobs-mode processed_logprobs`` and is refused when log-probs are asked of it otherwise.

Pure helpers (knob checks, sampling-parameter mapping, weight names, rollout assembly) are ``check_vllm_knobs``,
``vllm_sampling_params``, ``vllm_weights`` and ``padded_completions``. See docs/vllm.md for what was and was not
run.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.request
from typing import Any, Callable, Iterator

import lightning as L
import torch

from lightalign.modules.sampling.generate import SAMPLING_KNOBS
from lightalign.modules.sampling.samplers import Sampler
from lightalign.modules.sampling.vllm import (INSTALL_HINT, VLLMConfig, padded_completions, vllm_sampling_params,
                                                vllm_weights)


def _import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"use_vllm: true needs vLLM: {INSTALL_HINT}.") from err
    return vllm


PROCESSED = "processed_logprobs"  # vLLM's logprobs_mode whose log-probs are the distribution actually sampled from


def _sampled_logprobs(sample: Any) -> list[float]:
    """Each sampled token's log-prob in a vLLM ``CompletionOutput`` (``logprobs``: one ``{token_id: Logprob}`` per
    position, holding the sampled token and any top alternatives); NaN where vLLM gave none."""
    if sample.logprobs is None:
        raise RuntimeError("vLLM returned no log-probs although they were asked for (SamplingParams.logprobs=0).")
    if len(sample.logprobs) != len(sample.token_ids):
        raise RuntimeError(f"vLLM returned {len(sample.logprobs)} log-prob positions for {len(sample.token_ids)} "
                           "sampled tokens.")
    out = []
    for token, position in zip(sample.token_ids, sample.logprobs):
        entry = None if position is None else position.get(token)
        value = None if entry is None else entry.logprob
        out.append(float("nan") if value is None else float(value))
    return out


def _choice_logprobs(choice: dict[str, Any]) -> list[float]:
    """Each sampled token's log-prob in a ``/v1/completions`` choice (``logprobs.token_logprobs``, aligned with
    ``token_ids``: ``logprobs.tokens`` name them as ``token_id:<id>``); NaN where the server gave none."""
    logprobs = choice.get("logprobs")
    if logprobs is None:
        raise RuntimeError("the vLLM server returned no log-probs although they were asked for (logprobs=0).")
    tokens = [f"token_id:{token}" for token in choice["token_ids"]]
    if logprobs["tokens"] != tokens:
        raise RuntimeError(f"the vLLM server's log-probs are for tokens {logprobs['tokens'][:8]}..., not the sampled "
                           f"{tokens[:8]}...")
    return [float("nan") if value is None else float(value) for value in logprobs["token_logprobs"]]


class ColocatedEngine:
    """A ``vllm.LLM`` in this process, on this process's GPU (one engine per training rank)."""

    def __init__(self, model_name_or_path: str, *, gpu_memory_utilization: float, max_model_length: int | None,
                 enable_sleep_mode: bool, model_impl: str, seed: int, dtype: str = "auto",
                 trust_remote_code: bool = False, distributed: bool = False) -> None:
        vllm = _import_vllm()
        kwargs = dict(model=model_name_or_path, tensor_parallel_size=1, gpu_memory_utilization=gpu_memory_utilization,
                      max_model_len=max_model_length, enable_sleep_mode=enable_sleep_mode, model_impl=model_impl,
                      seed=seed, dtype=dtype, trust_remote_code=trust_remote_code,
                      logprobs_mode=PROCESSED)  # after temperature and the sampling filters (vLLM>=0.10.2, as TRL)
        if distributed:  # the engine joins the ranks Lightning already launched instead of spawning its own
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.llm = vllm.LLM(**kwargs)
        self.sleep_mode = enable_sleep_mode
        if enable_sleep_mode:
            self.llm.sleep(level=2)  # weights and KV cache released until the first push

    def generate(self, prompts: list[list[int]], params: dict[str, Any]
                 ) -> tuple[list[list[int]], list[list[float]] | None]:
        vllm = _import_vllm()
        if self.sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                                    sampling_params=vllm.SamplingParams(**params), use_tqdm=False)
        if self.sleep_mode:
            self.llm.sleep(level=2)
        samples = [sample for request in outputs for sample in request.outputs]
        logps = [_sampled_logprobs(sample) for sample in samples] if "logprobs" in params else None
        return [list(sample.token_ids) for sample in samples], logps

    def load_weights(self, weights: Callable[[], Iterator[tuple[str, torch.Tensor]]], send: bool = True) -> None:
        """``weights()``: a fresh iterator of (vLLM name, tensor); each tensor is used before the next is made
        (LoRA-merged values exist only while the iteration runs)."""
        if self.sleep_mode:
            self.llm.wake_up(tags=["weights"])
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        for name, tensor in weights():
            model.load_weights([(name, tensor)])
        self.llm.reset_prefix_cache()  # cached prefixes were computed by the old weights


class ServerEngine:
    """A running ``vllm serve`` server: completions over HTTP, weights over vLLM's NCCL weight-transfer group."""

    def __init__(self, base_url: str, *, group_port: int, timeout: float, sender: bool,
                 weight_sync_timeout: float = 1800.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.group_port, self.timeout, self.sender = group_port, timeout, sender
        self.weight_sync_timeout = weight_sync_timeout
        self.model_id = self._get("/v1/models")["data"][0]["id"]
        self.group = None
        self.meta: list[tuple[str, str, list[int]]] | None = None
        self.logprobs_mode: str | None = None  # the server's, read when log-probs are first asked for

    def _request(self, path: str, payload: dict[str, Any] | None = None, method: str = "POST",
                 timeout: float | None = None) -> Any:
        """``timeout``: seconds (default ``vllm_server_timeout``; 0: none)."""
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=(self.timeout if timeout is None else timeout) or None
                                        ) as response:
                body = response.read()
        except OSError as err:
            raise ConnectionError(f"vLLM server at {self.base_url}{path} failed: {err}. Is `vllm serve` running "
                                  "there (vllm_server_base_url / vllm_server_host / vllm_server_port)?") from err
        return json.loads(body) if body else None

    def _get(self, path: str) -> Any:
        return self._request(path, method="GET")

    def check_logprobs_mode(self) -> None:
        """Refuse a server whose log-probs are not the sampling distribution's (its ``--logprobs-mode``, read from
        the dev route ``/server_info``)."""
        if self.logprobs_mode is None:
            try:
                config = self._get("/server_info?config_format=json")["vllm_config"]
                self.logprobs_mode = config["model_config"]["logprobs_mode"]
            except (ConnectionError, KeyError, TypeError) as err:
                raise ConnectionError(
                    f"could not read the logprobs mode of the vLLM server at {self.base_url} from /server_info "
                    f"({err}); the sampler's log-probs need a server started with VLLM_SERVER_DEV_MODE=1 and "
                    f"--logprobs-mode {PROCESSED}.") from err
        if self.logprobs_mode != PROCESSED:
            raise ValueError(
                f"the vLLM server at {self.base_url} runs with --logprobs-mode {self.logprobs_mode}: its log-probs are "
                "not those of the distribution it samples from (temperature, top-k/top-p/min-p applied), which the "
                f"sampler's log-probs must be. Restart it with `--logprobs-mode {PROCESSED}`.")

    def generate(self, prompts: list[list[int]], params: dict[str, Any]
                 ) -> tuple[list[list[int]], list[list[float]] | None]:
        params = {k: v for k, v in params.items() if k != "detokenize"}
        payload = {"model": self.model_id, "prompt": prompts, "return_token_ids": True, **params}
        if "logprobs" in params:
            self.check_logprobs_mode()
            payload["return_tokens_as_token_ids"] = True  # logprobs.tokens as "token_id:<id>", checked below
        choices = self._request("/v1/completions", payload)["choices"]
        choices = sorted(choices, key=lambda c: c.get("index", 0))  # prompt-major: a prompt's n samples together
        completions = [list(choice["token_ids"]) for choice in choices]
        if "logprobs" not in params:
            return completions, None
        return completions, [_choice_logprobs(choice) for choice in choices]

    def _meet(self, what: str, path: str, payload: dict[str, Any], trainer_side: Callable[[], Any]) -> Any:
        """One collective with the server's workers: ``trainer_side`` (this process's NCCL part, which has no timeout
        and cannot be interrupted) runs on a daemon thread while the request to ``path`` drives the server's part on
        this one; both must finish within ``vllm_weight_sync_timeout``. A server that fails answers the request with
        an error, one that hangs is reported when the time is up: a clear error instead of a hang (the abandoned
        thread ends with the process)."""
        done: list[Any] = []

        def run() -> None:
            try:
                done.append(("ok", trainer_side()))
            except BaseException as err:  # noqa: BLE001 - raised on the calling thread below
                done.append(("error", err))

        deadline = time.monotonic() + self.weight_sync_timeout
        thread = threading.Thread(target=run, name=f"lightalign-vllm-{what.replace(' ', '-')}", daemon=True)
        thread.start()
        try:
            self._request(path, payload, timeout=self.weight_sync_timeout)
        except ConnectionError as err:
            raise ConnectionError(f"The vLLM server failed the {what}: {err} (vllm_weight_sync_timeout: "
                                  f"{self.weight_sync_timeout:g} s).") from err
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            raise TimeoutError(f"The {what} with the vLLM server at {self.base_url} did not finish within "
                               f"vllm_weight_sync_timeout ({self.weight_sync_timeout:g} s): the server answered, this "
                               "process's NCCL side is still waiting (a worker gone, a blocked network path on "
                               f"vllm_group_port {self.group_port}). Raise vllm_weight_sync_timeout for a model that "
                               "takes longer to send.")
        kind, value = done[0]
        if kind == "error":
            raise value
        return value

    def _connect(self) -> None:
        """Join the server's weight-transfer group as rank 0 (its workers are ranks 1..)."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.utils.network_utils import get_ip

        info = {"master_address": get_ip(), "master_port": self.group_port, "rank_offset": 1,
                "world_size": self._get("/get_world_size")["world_size"] + 1, "packed": True}
        self.group = self._meet("weight-transfer set-up", "/init_weight_transfer_engine", {"init_info": info},
                                lambda: trainer_init(info))

    def load_weights(self, weights: Callable[[], Iterator[tuple[str, torch.Tensor]]], send: bool = True) -> None:
        """``weights()``: a fresh iterator of (vLLM name, tensor). The server must know every tensor's name, dtype
        and shape before the broadcast starts: a first walk (first push only) reads them, the second streams."""
        if self.meta is None:
            self.meta = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in weights()]
        if not send:  # other ranks only take part in gathering sharded parameters
            for _ in weights():
                pass
            return
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        if self.group is None:
            self._connect()
        info = {"names": [m[0] for m in self.meta], "dtype_names": [m[1] for m in self.meta],
                "shapes": [m[2] for m in self.meta]}
        self._request("/start_weight_update", {})
        try:
            self._meet("weight update", "/update_weights", {"update_info": info},
                       lambda: packed_nccl_broadcast_producer(weights(), group=self.group, src=0,
                                                              post_iter_func=lambda item: item[1].contiguous()))
        except BaseException:
            with contextlib.suppress(ConnectionError):  # the server leaves its update state; the error is the news
                self._request("/finish_weight_update", {})
            raise
        self._request("/finish_weight_update", {}, timeout=self.weight_sync_timeout)
        try:  # prefixes cached under the old weights must not be reused
            self._request("/reset_prefix_cache", {})
        except ConnectionError as err:
            raise ConnectionError(f"{err} The server must reset its prefix cache after each weight update: start it "
                                  "with VLLM_SERVER_DEV_MODE=1, which enables /reset_prefix_cache.") from err


class VLLMSampler(Sampler):
    """The ``vllm`` sampler: the engine's completions, with the ``Sampler`` call signature of every backend."""

    name = "vllm"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.pushed_step: int | None = None

    def sample(self, model, prompt_ids, prompt_mask, num_generations, *, eos, pad_token_id, max_new_tokens,
               share_prefill=True, continuous_config=None, return_logprobs=False, **sampling):
        """``sampling["seed"]``: vLLM's sampling seed, given by a caller on another thread (drawn on the training
        thread); default drawn here from the run's torch RNG (seeded runs sample alike)."""
        seed = sampling.pop("seed", None)
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, ()))
        generation_kwargs = {k: v for k, v in sampling.items() if k not in SAMPLING_KNOBS}
        params = vllm_sampling_params(
            num_generations=num_generations, temperature=sampling.get("temperature", 1.0),
            top_p=sampling.get("top_p", 1.0), top_k=sampling.get("top_k"), min_p=sampling.get("min_p"),
            repetition_penalty=sampling.get("repetition_penalty", 1.0), max_completion_length=max_new_tokens,
            eos_token_ids=eos, generation_kwargs=generation_kwargs or None, seed=seed, logprobs=return_logprobs)
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        completions, logps = self.engine.generate(prompts, params)
        if return_logprobs and logps is None:
            raise RuntimeError("the vLLM engine returned no log-probs although they were asked for.")
        return padded_completions(completions, len(prompts), num_generations, pad_token_id, prompt_ids.device,
                                  logps=logps if return_logprobs else None)

    def push(self, model: torch.nn.Module, step: int, sender: bool = True) -> None:
        self.engine.load_weights(lambda: vllm_weights(model), send=sender)
        self.pushed_step = step


def build_engine(module: Any, trainer: L.Trainer, who: str = "policy", model_path: str | None = None) -> Any:
    """The engine ``who`` samples through (``SamplingModule.vllm_models``): the server (server mode), or a colocated
    ``vllm.LLM`` loaded from ``model_path`` (default: the module's model) in the model's dtype."""
    config = VLLMConfig.of(module)
    if config.vllm_mode == "server":
        return ServerEngine(config.server_url, group_port=config.vllm_group_port, timeout=config.vllm_server_timeout,
                            sender=trainer.global_rank == 0, weight_sync_timeout=config.vllm_weight_sync_timeout)
    if trainer.world_size > 1:  # vLLM's external launcher reads the rendezvous Lightning set up
        os.environ.setdefault("RANK", str(trainer.global_rank))
        os.environ.setdefault("LOCAL_RANK", str(trainer.local_rank))
        os.environ.setdefault("WORLD_SIZE", str(trainer.world_size))
    model = {name: m for name, m, _, _ in module.vllm_models()}[who]
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return ColocatedEngine(model_path or module.model_name_or_path,
                           gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                           max_model_length=config.vllm_max_model_length,
                           enable_sleep_mode=config.vllm_enable_sleep_mode, model_impl=config.vllm_model_impl,
                           seed=trainer.global_rank, dtype=dtype,
                           trust_remote_code=module.knobs.model.trust_remote_code,
                           distributed=trainer.world_size > 1)


def push_weights(sampler: VLLMSampler, trainer: L.Trainer, module: Any, model: torch.nn.Module | None = None) -> None:
    """``model``'s weights (default: the module's policy) into the engine (rank 0 sends; every rank waits until they
    are in)."""
    sampler.push(module.model if model is None else model, trainer.global_step, sender=trainer.global_rank == 0)
    if trainer.world_size > 1:
        trainer.strategy.barrier("vllm_weights")  # no rank samples before the new weights are in


class VLLMRollouts(L.Callback):
    """Builds a vLLM engine per model that samples (``module.vllm_models()``: the policy or student; a ``seq_kd``
    teacher) at fit start and pushes its weights then; the model being trained gets its weights pushed again after
    every optimizer step (so each sampling is by the model being trained), a frozen one never again. The module's
    ``Sampling`` component samples through them for the fit (``Sampling.use_engine``). With rollouts sampled ahead
    (``max_staleness``) the off-policy component pushes instead, between rollouts
    (``EngineAhead``).

    ``engine_factory(module, trainer, who, model_path)``: how an engine is made (default: this module's
    ``build_engine``, looked up at fit start; tests pass or patch in a fake)."""

    def __init__(self, engine_factory=None) -> None:
        self.engine_factory = engine_factory
        self.sampler: VLLMSampler | None = None  # the trained model's
        self.followers: list[tuple[VLLMSampler, torch.nn.Module]] = []  # (sampler, model) of the models in training

    def on_fit_start(self, trainer: L.Trainer, module: Any) -> None:
        factory = self.engine_factory or build_engine
        mode = module.knobs.vllm.vllm_mode
        self.followers = []
        for who, model, path, follows in module.vllm_models():
            sampler = VLLMSampler(factory(module, trainer, who, path))
            push_weights(sampler, trainer, module, model)
            module.sampling.use_engine(who, sampler, f"sampler vllm (use_vllm, vllm_mode {mode})")
            if follows:
                self.followers.append((sampler, model))
        self.sampler = self.followers[0][0] if self.followers else None

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        off_policy = getattr(module, "off_policy", None)
        if off_policy is not None and off_policy.max_staleness > 0:
            return
        for sampler, model in self.followers:
            if sampler.pushed_step != trainer.global_step:
                push_weights(sampler, trainer, module, model)  # an optimizer step ran

    def on_fit_end(self, trainer: L.Trainer, module: Any) -> None:
        module.sampling.release()
