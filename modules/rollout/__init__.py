"""The online-RL loop as explicit stages: sample -> score (rewards) -> advantages -> buffer of micro-batches; GRPO,
RLOO and PPO plug in their objective."""
