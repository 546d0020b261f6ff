"""Sampling completions: one sampler interface and one file per backend (generate, compact, continuous, static,
vllm)."""
