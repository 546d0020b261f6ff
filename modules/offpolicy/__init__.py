"""Rollouts not sampled by the policy being trained, and their correction: a sampler running ahead of training on
weights at most ``max_staleness`` optimizer steps old (``AheadSampler``, its process's ``serve``), the
importance-sampling correction of the gap between the sampler's log-probs and the trainer's
(``importance_sampling_ratio``, TRL's ``vllm_importance_sampling_*``), and the component a method composes them with
(``OffPolicyRollouts``)."""
