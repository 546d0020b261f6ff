"""What an online-RL run keeps in its checkpoints beside the weights: the generation count, every rank's rollout
buffer (under DDP each rank trains on its own prompts, so each resumes its own; every rank gathers, rank 0 writes)
with the sample table of its rollout (``last_samples``: ``CompletionSamples`` writes it on the steps the
rollout serves, so a run resumed mid-rollout writes the rows the uninterrupted one wrote) and the method's own
state (``method_state``: the same on every rank; ``rank_state``: per rank), so a resumed run continues mid-rollout
exactly as the uninterrupted one."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lightalign.modules.training.rng_state import gather_per_rank

KEY = "lightalign_rollout"
OLD_KEY = "lightalign_grpo"  # checkpoints written before the online-RL loop was one component


def save_rollout_state(module: Any, checkpoint: dict[str, Any]) -> None:
    checkpoint[KEY] = {"generation_count": module.generation_count, "ranks": gather_per_rank(module.rank_state()),
                       **module.method_state()}


def load_rollout_state(module: Any, checkpoint: dict[str, Any]) -> None:
    state = checkpoint.get(KEY, checkpoint.get(OLD_KEY, {}))
    module.generation_count = state.get("generation_count", 0)
    module.load_method_state(state)
    ranks = state.get("ranks", [state])  # (checkpoints before per-rank state held rank 0's at the top level)
    world = module.trainer.world_size if module._trainer is not None else 1
    if len(ranks) != world:
        rank_zero_warn(f"This checkpoint holds the rollout state of {len(ranks)} rank(s) and the run has {world}: "
                       "the rollout in progress is dropped (the next training step generates a new one), so the "
                       "run does not continue exactly as it would have.")
        ranks = [{}] * world
    own = ranks[module.global_rank if module._trainer is not None else 0]
    module.rollout_buffer.load_state_dict(own)
    module.last_samples = list(own.get("last_samples", []))  # the sample table of the rollout in training
    module.off_policy.load_state_dict(own)
    module.load_rank_state(own)
