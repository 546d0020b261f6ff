"""Sampling completions, in one place, for every method that trains on completions its models sample (online RL,
distillation, online DPO): the sampling knobs' one definition (``config.py``: ``SamplingConfig``, TRL's names;
``module.py``: ``SamplingModule``), the sampler interface and registry (``samplers.py``) with one file per backend
(``generate.py``, ``compact.py``, ``continuous.py``, ``static.py``, ``vllm.py`` and its engines ``vllm_engines.py``),
the choice of backend at fit start (``choice.py``), a rollout's completions cut and decoded (``completions.py``), and
the component every method samples through (``component.py``: ``Sampling``)."""
