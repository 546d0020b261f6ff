"""Strategy presets: ``ddp``, ``fsdp``, ``fsdp2``, ``deepspeed_zero{1,2,3}`` and ``deepspeed_zero{2,3}_offload``.

Python: ``L.Trainer(strategy=make_strategy("fsdp2"))``; YAML: ``--trainer.strategy configs/strategies/fsdp2.yaml``
(the files there name these classes). Everything is Lightning's own strategy, configured for post-training:

* ``fsdp``: ``DecoderFSDPStrategy``, Lightning's ``FSDPStrategy`` wrapping each decoder layer (``_no_split_modules``), full or sharded
  checkpoints, optional CPU offload, activation checkpointing per decoder layer, mixed precision.
* ``fsdp2``: ``FSDP2Strategy`` (Lightning's ``ModelParallelStrategy``, data parallel only) that applies
  ``fully_shard`` per decoder layer after the module built its model (and its frozen reference, which stays
  replicated).
* ``deepspeed_*``: ``DeepSpeedZeroStrategy`` (Lightning's ``DeepSpeedStrategy``; under ZeRO-3 transformers
  partitions the model as it loads) with the configs of ``deepspeed_config``.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy

from lightalign.strategies.deepspeed_configs import deepspeed_config
from lightalign.strategies.sharding import DecoderLayerPolicy, shard_decoder_layers

#: A rank that died makes the others fail after this many seconds instead of waiting forever.
DEFAULT_TIMEOUT_S = 1800


def _dtype(name: str | None):
    import torch

    return None if name is None else getattr(torch, str(name).removeprefix("torch."))


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 (``fully_shard``) over all processes, one shard unit per decoder layer, applied to the module's ``model``.

    Args:
        layer_names: decoder-layer class names (default: the model's ``_no_split_modules``).
        reshard_after_forward: free gathered layers after their forward (ZeRO-3-like; False keeps them, ZeRO-2-like).
        param_dtype, reduce_dtype: FSDP2 mixed precision (e.g. ``bfloat16`` / ``float32``); None: the model's dtype.
        cpu_offload: keep sharded parameters and optimizer state on CPU.
        save_distributed_checkpoint: one sharded checkpoint folder (True) or a single full file (False).
        timeout_s: collective timeout; a dead rank becomes an error after it.
    """

    def __init__(self, layer_names: list[str] | None = None, reshard_after_forward: bool = True,
                 param_dtype: str | None = None, reduce_dtype: str | None = None, cpu_offload: bool = False,
                 save_distributed_checkpoint: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         timeout=timedelta(seconds=timeout_s), **kwargs)
        self.layer_names = layer_names
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.cpu_offload = cpu_offload

    def setup_environment(self) -> None:
        # pure data parallelism over every process of every node
        if self._data_parallel_size == "auto" and self._tensor_parallel_size == "auto":
            self._data_parallel_size, self._tensor_parallel_size = self.num_nodes * self.num_processes, 1
        super().setup_environment()

    def setup(self, trainer) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        module = self.lightning_module
        model = getattr(module, "model", None)
        if model is None:
            raise TypeError(f"FSDP2Strategy shards the `model` attribute of lightalign modules; {type(module).__name__} has none.")
        mp = None
        if self.param_dtype or self.reduce_dtype:
            mp = MixedPrecisionPolicy(param_dtype=_dtype(self.param_dtype), reduce_dtype=_dtype(self.reduce_dtype))
        offload = CPUOffloadPolicy() if self.cpu_offload else None
        shard_decoder_layers(model, self.device_mesh["data_parallel"], self.layer_names, self.reshard_after_forward,
                             mp_policy=mp, offload_policy=offload)
        # other trained modules beside `model` (PPO's value head and value model): sharded too, or their plain
        # tensors would meet DTensors in the gradient norm and their gradients would not be reduced over ranks
        for extra in getattr(module, "sharded_submodules", lambda: [])():
            layered = any(getattr(m, "_no_split_modules", None) for m in extra.modules())  # a value model, not a head
            shard_decoder_layers(extra, self.device_mesh["data_parallel"], None if layered else [],
                                 self.reshard_after_forward, mp_policy=mp, offload_policy=offload)
        super().setup(trainer)


class DecoderFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP v1) with one FSDP unit per decoder layer (``_no_split_modules``).

    Args:
        state_dict_type: ``sharded`` (one file per rank, fast) or ``full`` (one file, gathered on rank 0).
        cpu_offload: keep parameters (and gradients) on CPU.
        activation_checkpointing: recompute each decoder layer's activations in backward.
        layer_names: decoder-layer class names (default: the model's ``_no_split_modules``).
        param_dtype, reduce_dtype: FSDP mixed precision (e.g. ``bfloat16``); None: the model's dtype.
        timeout_s: collective timeout; a dead rank becomes an error after it.
        Other keyword arguments go to ``FSDPStrategy``.
    """

    def __init__(self, state_dict_type: Literal["full", "sharded"] = "sharded", cpu_offload: bool = False,
                 activation_checkpointing: bool = False, layer_names: list[str] | None = None,
                 param_dtype: str | None = None, reduce_dtype: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> None:
        from torch.distributed.fsdp import MixedPrecision

        mp = None
        if param_dtype or reduce_dtype:
            mp = MixedPrecision(param_dtype=_dtype(param_dtype), reduce_dtype=_dtype(reduce_dtype),
                                buffer_dtype=_dtype(param_dtype))
        super().__init__(
            auto_wrap_policy=DecoderLayerPolicy(layer_names),
            activation_checkpointing_policy=DecoderLayerPolicy(layer_names) if activation_checkpointing else None,
            state_dict_type=state_dict_type, cpu_offload=cpu_offload, mixed_precision=mp,
            timeout=timedelta(seconds=timeout_s), **kwargs,
        )


class DeepSpeedZeroStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy``; under ZeRO-3, transformers partitions the model while it loads.

    Lightning builds the model inside ``deepspeed.zero.Init``, where ``from_pretrained``/``from_config`` write
    into already-partitioned (empty) tensors and fail. Registering the config with transformers
    (``HfDeepSpeedConfig``) instead makes transformers create the model under ``zero.Init`` itself and load or
    initialise each weight gathered. Reference copies are then made from gathered weights (``create_reference_model``).
    Args are ``DeepSpeedStrategy``'s; ``timeout_s`` bounds every collective.
    """

    def __init__(self, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> None:
        kwargs.setdefault("timeout", timedelta(seconds=timeout_s))
        super().__init__(*args, **kwargs)

    @contextmanager
    def model_sharded_context(self):
        if not self.zero_stage_3:
            with super().model_sharded_context():
                yield
            return
        from transformers.integrations import HfDeepSpeedConfig

        self._init_config_if_needed()
        self._hf_ds_config = HfDeepSpeedConfig(self.config)  # transformers keeps a weak reference: hold it
        yield


def deepspeed_strategy(stage: int, offload: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                       **config: Any) -> DeepSpeedZeroStrategy:
    """``DeepSpeedZeroStrategy`` with ``deepspeed_config(stage, offload)`` (``config`` keys override it)."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as err:
        raise ImportError("DeepSpeed strategies need deepspeed: pip install 'lightalign[deepspeed]'") from err
    return DeepSpeedZeroStrategy(config=deepspeed_config(stage, offload, **config), timeout_s=timeout_s)


PRESETS = ("ddp", "fsdp", "fsdp_full", "fsdp_offload", "fsdp2", "deepspeed_zero1", "deepspeed_zero2",
           "deepspeed_zero3", "deepspeed_zero2_offload", "deepspeed_zero3_offload")


def make_strategy(name: str, **overrides: Any) -> Strategy:
    """A configured strategy by preset name (see ``PRESETS``); ``overrides`` go to the factory."""
    if name == "ddp":
        overrides.setdefault("timeout", timedelta(seconds=overrides.pop("timeout_s", DEFAULT_TIMEOUT_S)))
        return DDPStrategy(**overrides)
    if name == "fsdp":
        return DecoderFSDPStrategy(**overrides)
    if name == "fsdp_full":
        return DecoderFSDPStrategy(state_dict_type="full", **overrides)
    if name == "fsdp_offload":
        return DecoderFSDPStrategy(cpu_offload=True, **overrides)
    if name == "fsdp2":
        return FSDP2Strategy(**overrides)
    if name.startswith("deepspeed_zero"):
        rest = name.removeprefix("deepspeed_zero")
        stage, _, suffix = rest.partition("_")
        if stage in ("1", "2", "3") and suffix in ("", "offload") and not (stage == "1" and suffix):
            return deepspeed_strategy(int(stage), offload=suffix == "offload", **overrides)
    raise ValueError(f"Unknown strategy preset '{name}'; use one of {', '.join(PRESETS)}.")
