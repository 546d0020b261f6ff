"""CPU-only test helpers (NOT part of the package): Lightning refuses DeepSpeed on a CPU accelerator, but DeepSpeed
itself runs ZeRO-2/3 on CPU with gloo. Users get Lightning's own strategies (lightalign.strategies.make_strategy)."""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import DDPStrategy

from lightalign.strategies.presets import DeepSpeedZeroStrategy


class CPUDeepSpeedStrategy(DeepSpeedZeroStrategy):
    """lightalign's ``DeepSpeedZeroStrategy`` minus its CUDA-only checks, for 2-process gloo tests on CPU."""

    def setup_environment(self) -> None:
        # CPU devices carry no index, which DeepSpeed reads as the local rank: number them (cpu:0, cpu:1, ...)
        self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
        # DeepSpeed JIT-compiles a shared-memory all-reduce for CPU at init (minutes on a fresh machine); gloo suffices
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        DDPStrategy.setup_environment(self)  # skip DeepSpeedStrategy's "only supported on CUDA GPUs" check
