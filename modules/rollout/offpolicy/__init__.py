"""Asynchronous rollouts: a sampler running ahead of training on weights at most ``max_staleness`` optimizer steps old
(``AheadSampler``, its process's ``serve``; a vLLM server on a thread: ``EngineAhead``), and the component a method
composes them with (``OffPolicyRollouts``). The importance-sampling correction of the gap between the sampler's
log-probs and the trainer's (``importance_sampling_ratio``, TRL's ``vllm_importance_sampling_*``) is a loss concern:
``lightalign.modules.losses.importance_sampling``."""
