"""What sharded strategies need from the model side: which layers to shard, full weights for the export, and
full parameters for ``generate`` (GRPO rollouts).

* ``decoder_layer_names``: the model's decoder-layer classes, read from ``_no_split_modules`` (transformers).
* ``DecoderLayerPolicy``: an FSDP (v1) wrap / activation-checkpointing policy built from those names.
* ``shard_decoder_layers``: FSDP2 (``fully_shard``) per decoder layer, then the whole model.
* ``generation_context``: parameters gathered for ``generate`` and released after (FSDP2, FSDP, ZeRO-3), and
  the ``generate`` kwargs that keep ranks in lock-step (``synced_gpus``) when a forward is a collective.
* ``full_state_dict``: the policy's full (unsharded) weights — a collective: every rank calls it (FSDP v1: with its root).
* ``loading_whole``: models loaded inside it (a separate reference, a reward model) load whole under ZeRO-3.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch
from torch.distributed.fsdp.wrap import CustomPolicy


def decoder_layer_names(model: torch.nn.Module) -> set[str]:
    """Class names listed in ``_no_split_modules`` by the model (or any submodule, e.g. under a LoRA wrapper)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(
            f"{type(model).__name__} declares no decoder-layer classes (_no_split_modules), so the layers to shard are "
            "unknown. Pass them explicitly (FSDP: auto_wrap_policy={MyDecoderLayer}; FSDP2: layer_names=[...])."
        )
    return names


class DecoderLayerPolicy(CustomPolicy):
    """FSDP wrap (or activation-checkpointing) policy: one unit per decoder layer named by ``_no_split_modules``.

    The names are read from the model when FSDP applies the policy, so a preset needs no model-specific class.
    """

    def __init__(self, layer_names: list[str] | None = None) -> None:
        super().__init__(self._is_layer)
        self.layer_names = set(layer_names or [])

    def _is_layer(self, module: torch.nn.Module) -> bool:
        return type(module).__name__ in self.layer_names

    def _run_policy(self, root_module, ignored_modules, root_kwargs):
        if not self.layer_names:
            self.layer_names = decoder_layer_names(root_module)
        return super()._run_policy(root_module, ignored_modules, root_kwargs)


def shard_decoder_layers(model: torch.nn.Module, mesh: Any = None, layer_names: list[str] | None = None,
                         reshard_after_forward: bool = True, mp_policy: Any = None, offload_policy: Any = None) -> int:
    """FSDP2: ``fully_shard`` every decoder layer, then the model (embeddings, norm, head). Returns the layer count.
    ``layer_names``: the decoder-layer classes (None: the model's ``_no_split_modules``; ``[]``: none, the model is
    one unit)."""
    from torch.distributed.fsdp import fully_shard

    names = set(decoder_layer_names(model) if layer_names is None else layer_names)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    layers = [m for m in model.modules() if type(m).__name__ in names]
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return len(layers)


def sharding_kind(model: torch.nn.Module) -> str | None:
    """``fsdp2`` | ``fsdp`` | ``zero3`` | None (replicated parameters: single process, DDP, ZeRO-1/2)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    for module in model.modules():
        if isinstance(module, FSDPModule):
            return "fsdp2"
        if isinstance(module, FullyShardedDataParallel):
            return "fsdp"
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return "zero3"
    return None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


@contextmanager
def generation_context(model: torch.nn.Module) -> Iterator[dict[str, Any]]:
    """Full parameters for the duration of ``generate``; yields extra ``generate`` kwargs.

    Under sharding a forward pass is a collective, and ranks can finish generating after different numbers of
    tokens (EOS); ``synced_gpus=True`` makes finished ranks keep stepping until all are done, so no rank waits
    forever. The gathered parameters are released (resharded) on exit.
    """
    kind = sharding_kind(model)
    extra = {"synced_gpus": True} if kind is not None and _distributed() else {}
    if kind == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        try:
            yield extra
        finally:
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(True, recurse=False)
        return
    if kind == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            yield extra
        return
    # FSDP (v1) gathers per wrapped unit in each forward; summon_full_params forbids forward passes inside it.
    yield extra


def full_state_dict(model: torch.nn.Module, root: torch.nn.Module | None = None) -> dict[str, torch.Tensor] | None:
    """The model's full weights on CPU (collective under sharding: call on every rank, use the result on rank 0,
    other ranks may get an empty dict); None when unsharded.

    ``root``: under FSDP (v1), the FSDP module that wraps ``model`` (Lightning's ``trainer.strategy.model``). FSDP v1
    gathers from its root only: the root holds the weights outside the decoder layers (embeddings, norm, head), and
    a state dict taken below it would also mark the first layer as a root and break the next forward.
    """
    kind = sharding_kind(model)
    if kind is None:
        return None
    if kind == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if kind == "fsdp2":
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    from torch.distributed.fsdp import FullyShardedDataParallel

    root = model if root is None and isinstance(model, FullyShardedDataParallel) else root
    if not isinstance(root, FullyShardedDataParallel) or not any(m is model for m in root.modules()):
        raise ValueError("Under FSDP (v1) full_state_dict needs root=<the FSDP module wrapping the model> "
                         "(trainer.strategy.model in Lightning).")
    prefix = "" if root is model else next(n for n, m in root.module.named_modules() if m is model) + "."
    prefix = prefix.replace("_fsdp_wrapped_module.", "")  # the state dict's names have no FSDP wrappers
    # FSDP (v1) "offloads" each gathered tensor with .to("cpu") and then frees the gathered storage: for parameters
    # already on CPU that is the same storage, and the state dict would point at freed memory (a segfault)
    offload = any(p.device.type != "cpu" for p in model.parameters())
    state = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    return {k.removeprefix(prefix): v.detach().cpu() for k, v in state.items() if k.startswith(prefix)}


@contextmanager
def full_parameters_for_copy(model: torch.nn.Module) -> Iterator[None]:
    """ZeRO-3 partitions parameters at creation; a frozen reference copied from the policy needs them whole."""
    with ExitStack() as stack:
        if sharding_kind(model) == "zero3":
            import deepspeed

            stack.enter_context(deepspeed.zero.GatheredParameters(list(model.parameters())))
        yield


@contextmanager
def loading_whole() -> Iterator[None]:
    """Models loaded inside this context load whole, even during a ZeRO-3 run.

    ``DeepSpeedZeroStrategy`` registers its config with transformers for the whole run (``generate`` reads it
    to keep ranks in step), and while it is registered ``from_pretrained`` partitions every model it loads. A
    separately loaded reference or reward model is never wrapped by DeepSpeed, so it must load whole: the
    registration is lifted here and restored on exit.
    """
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:
        yield
        return
    registered = hf_deepspeed._hf_deepspeed_config_weak_ref  # transformers exposes set/unset but no getter
    config = registered() if registered is not None else None
    if config is None:
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(config)
