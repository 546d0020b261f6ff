"""Scale and storage plumbing for Lightning's strategies (checkpoint IO now; DDP/FSDP/DeepSpeed presets later)."""

from lightalign.strategies.checkpoint_io import AtomicCheckpointIO, CheckpointError

__all__ = ["AtomicCheckpointIO", "CheckpointError"]
