"""Training on tokens the trained policy did not sample itself: a sampler (vLLM, another engine, a stale copy of the
weights) gives each sampled token a log-probability that differs from the trainer's own for the same token, and the
functions here measure that mismatch and turn it into the truncated or masked importance-sampling weights (TRL's
``vllm_importance_sampling_*`` knobs) that the losses in ``modules/losses`` accept."""
