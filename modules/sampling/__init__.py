"""Sampling completions, in one place, for every method that trains on completions its models sample (online RL,
distillation, online DPO): the sampling knobs' one definition (``SamplingConfig``, TRL's names, declared by
``SamplingModule``), the sampler interface and its registry (``Sampler``, ``SAMPLERS``) with one module per backend
(generate, compact, continuous, static, vLLM and its engines), the choice of backend at fit start
(``choose_sampler``), a rollout's completions cut and decoded (``sample_completions``), and the component every method
samples through (``Sampling``)."""
