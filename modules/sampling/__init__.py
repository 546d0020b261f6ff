"""A method that trains on completions its models sample (online RL, distillation, online DPO): the sampling knobs'
one definition (``SamplingModule``) and the component that samples with them (``Sampling``)."""
