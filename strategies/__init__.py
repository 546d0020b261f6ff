"""Scale and storage plumbing for Lightning's strategies: checkpoint IO, strategy presets (DDP, FSDP, FSDP2,
DeepSpeed ZeRO), sharding helpers (decoder-layer wrapping, gathered parameters for generation, full weights for
the export) and multi-node launch checks."""

from lightalign.strategies.checkpoint_io import AtomicCheckpointIO, CheckpointError
from lightalign.strategies.deepspeed_configs import deepspeed_config
from lightalign.strategies.launch import RankLogging, check_multinode_env
from lightalign.strategies.presets import (
    PRESETS,
    DecoderFSDPStrategy,
    DeepSpeedZeroStrategy,
    FSDP2Strategy,
    deepspeed_strategy,
    make_strategy,
)
from lightalign.strategies.sharding import DecoderLayerPolicy, full_state_dict, generation_context

__all__ = ["AtomicCheckpointIO", "CheckpointError", "DecoderFSDPStrategy", "DecoderLayerPolicy", "DeepSpeedZeroStrategy", "FSDP2Strategy", "PRESETS", "RankLogging",
           "check_multinode_env", "deepspeed_config", "deepspeed_strategy", "full_state_dict",
           "generation_context", "make_strategy"]
