"""The sampling process of asynchronous rollouts: it holds the policy's weights in shared memory (one copy per
slot, written by the training process between rollouts), samples each requested rollout on its slot with the run's
sampler and a seed drawn by the training process, and sends the rollout back. It exits when asked, when a request
fails (the error's traceback goes back first) and when the training process is gone (so a killed run leaves no
sampler behind)."""

from __future__ import annotations

import multiprocessing
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ModelSpec:
    """What the sampling process builds its models from: the policy's (base) transformers class, config and
    generation config, and each slot's weights (shared memory, written by the training process)."""
    cls: type
    config: Any
    generation_config: Any
    slots: list[dict[str, torch.Tensor]]


def build_slot_model(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A model of the policy's class whose parameters are ``weights`` themselves (shared, not copied)."""
    from lightalign.modules.adaptations.attention import VARLEN_SDPA, register_varlen_sdpa

    if getattr(spec.config, "_attn_implementation", None) == VARLEN_SDPA:
        register_varlen_sdpa()
    dtype = next(iter(weights.values())).dtype
    model = spec.cls._from_config(spec.config, dtype=dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    shared, params = {t.data_ptr() for t in weights.values()}, dict(model.named_parameters())
    untied = [k for k in missing if k in params and params[k].data_ptr() not in shared]
    if unexpected or untied:
        raise RuntimeError(f"The sampling copy of the policy does not fit its class {spec.cls.__name__}: weights "
                           f"without a place {unexpected[:3]}, parameters without weights {untied[:3]}.")
    model.generation_config = spec.generation_config
    return model.eval()


@dataclass
class Request:
    index: int  # the rollout's index in the run
    slot: int  # the weight slot to sample with
    batch: dict[str, Any]  # the PromptCollator batch
    num_generations: int
    seed: int


@dataclass
class Probe:
    """Ask for the log-softmax of the slot-0 model's logits on ``ids`` (the copy's exactness check)."""
    ids: torch.Tensor
    mask: torch.Tensor


@dataclass
class Reply:
    kind: str  # "ready" | "done" | "error"
    index: int = -1
    rollout: dict[str, Any] | None = None
    seconds: float = 0.0
    error: str = ""


def serve(requests: Any, replies: Any, spec: ModelSpec, tokenizer: Any, backend: str, sampling: dict[str, Any],
          threads: int) -> None:
    """The sampling process's loop (``multiprocessing`` spawn target)."""
    from lightalign.modules.sampling.completions import sample_completions

    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    try:
        slots = [build_slot_model(spec, weights) for weights in spec.slots]
    except BaseException:  # noqa: BLE001 - reported to the training process, which raises it
        replies.put(Reply("error", error=traceback.format_exc()))
        return
    parent = multiprocessing.parent_process()
    replies.put(Reply("ready"))
    while True:
        try:
            request = requests.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if request is None:
            return
        if isinstance(request, Probe):
            logits = slots[0](input_ids=request.ids, attention_mask=request.mask).logits.float()
            replies.put(Reply("probe", rollout={"logps": torch.log_softmax(logits, -1)}))
            continue
        try:
            start = time.perf_counter()
            torch.manual_seed(request.seed)
            rollout = sample_completions(slots[request.slot], tokenizer, request.batch, request.num_generations,
                                         backend=backend, return_logprobs=True, **sampling)
            replies.put(Reply("done", request.index, rollout, time.perf_counter() - start))
        except BaseException:  # noqa: BLE001 - reported to the training process, which raises it
            replies.put(Reply("error", request.index, error=traceback.format_exc()))
            return
