"""CPU-only test helpers (NOT part of the package): Lightning refuses DeepSpeed and FSDP (v1) on a CPU accelerator,
but both run on CPU with gloo. Users get Lightning's own strategies (lightalign.strategies.make_strategy)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from lightning.pytorch.strategies import DDPStrategy

from lightalign.strategies.presets import DecoderFSDPStrategy, DeepSpeedZeroStrategy


class CPUDeepSpeedStrategy(DeepSpeedZeroStrategy):
    """lightalign's ``DeepSpeedZeroStrategy`` minus its CUDA-only checks, for 2-process gloo tests on CPU."""

    def setup_environment(self) -> None:
        # CPU devices carry no index, which DeepSpeed reads as the local rank: number them (cpu:0, cpu:1, ...)
        self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
        # DeepSpeed JIT-compiles a shared-memory all-reduce for CPU at init (minutes on a fresh machine); gloo suffices
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        DDPStrategy.setup_environment(self)  # skip DeepSpeedStrategy's "only supported on CUDA GPUs" check


class CPUFSDPStrategy(DecoderFSDPStrategy):
    """lightalign's ``DecoderFSDPStrategy`` (FSDP v1, one unit per decoder layer) on CPU processes with gloo.

    Lightning hands FSDP ``device_id=root_device.index``, None on CPU, and FSDP then looks for an accelerator and
    fails; this wraps with ``device_id=cpu`` instead. (The Trainer's "requires a GPU accelerator" check only looks
    at the string "fsdp" and the exact class ``FSDPStrategy``, not at subclasses.)
    Full state dicts (``state_dict_type="full"``) are gathered without Lightning's ``offload_to_cpu``: FSDP
    "offloads" with ``.to("cpu")`` and then frees the gathered storage, which on CPU is the same storage, so rank 0
    would read freed memory (a segfault).
    """

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                         mixed_precision=self.mixed_precision_config,
                                         sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                                         **self.kwargs)
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model

    @contextmanager
    def _full_state_dict_context(self) -> Iterator[None]:
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)):
            yield

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._state_dict_type != "full":
            return super().lightning_module_state_dict()
        with self._full_state_dict_context():
            return self.model.state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self._state_dict_type != "full":
            return super().optimizer_state(optimizer)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import OptimStateKeyType

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        with self._full_state_dict_context():
            state = FSDP.optim_state_dict(self.model, optimizer)
        if self.global_rank == 0:  # keyed by parameter index, as a plain optimizer's state dict (as Lightning does)
            state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
        return state
