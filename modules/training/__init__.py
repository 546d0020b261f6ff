"""What every LightningModule of lightalign shares: loading the policy (``policy.PolicyModule``), LoRA and
activation checkpointing, optimizers and schedules, the Hugging Face export, RNG state in checkpoints, dropout,
NEFTune, speed knobs, per-token log-probs and the log-prob forward of each layout (SFT rows: ``sft_forward``;
preference pairs: ``preference_forward``; rollout micro-batches: ``rollout_forward``), PPO's value head."""
