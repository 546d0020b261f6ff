"""Tool and environment rollouts (agentic RL): tools, environments, the chat template's tool turns and the
multi-turn episode loop that GRPO and RLOO sample with when given ``tools`` or ``environment_factory``."""
