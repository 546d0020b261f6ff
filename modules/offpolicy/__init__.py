"""Rollouts not sampled by the policy being trained, and their correction: a sampler running ahead of training on
weights at most ``max_staleness`` optimizer steps old (``ahead.py``, ``worker.py``), the importance-sampling
correction of the gap between the sampler's log-probs and the trainer's (``correction.py``, TRL's
``vllm_importance_sampling_*``), and the component a method composes them with (``component.py``)."""
