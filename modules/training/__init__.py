"""What every LightningModule of lightalign shares: loading the policy (``policy.PolicyModule``), LoRA and
activation checkpointing, optimizers and schedules, the Hugging Face export, RNG state in checkpoints, dropout,
NEFTune, speed knobs, per-token log-probs, PPO's value head."""
