"""The benchmark's model class: the small Qwen2 config with its EOS logit raised by ``config.bench_eos_bias`` in
every forward (a hook on the output embedding registered by the class itself), so the random-weight model's
completions end at varied lengths. Being the class's own behaviour, a copy rebuilt from class, config and weights
(lightalign's asynchronous sampling process) computes the same logits; TRL's side gets the same hook on its loaded
model (bench/grpo.py: add_eos_bias)."""

from __future__ import annotations

import torch
from transformers import Qwen2ForCausalLM


def eos_bias_hook(eos: int, bias: float):
    vector = {}

    def hook(module, inputs, logits):
        key = (logits.device, logits.dtype)
        if key not in vector:
            vector[key] = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
            vector[key][eos] = bias
        return logits + vector[key]

    return hook


class EOSBiasedQwen2ForCausalLM(Qwen2ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        bias = getattr(config, "bench_eos_bias", None)
        if bias:
            self.get_output_embeddings().register_forward_hook(eos_bias_hook(config.bench_eos_token, bias))
