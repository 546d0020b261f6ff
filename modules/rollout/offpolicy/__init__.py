"""Asynchronous rollouts: a sampler running ahead of training on weights at most ``max_staleness`` optimizer steps old
(``ahead.py``, ``worker.py``; a vLLM server on a thread: ``engine_ahead.py``), and the component a method composes
them with (``component.py``). The importance-sampling correction of the gap between the sampler's log-probs and the
trainer's (TRL's ``vllm_importance_sampling_*``) is a loss concern: ``losses/importance_sampling.py``."""
