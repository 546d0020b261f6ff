"""``use_vllm: true`` on a CPU machine, with an engine that stands in for vLLM at its ``generate`` boundary (the real
engine runs only in the ``gpu`` tests; tests/sampling/test_vllm.py tests the engines themselves).

``vllm_module(cls, monkeypatch, engines, ...)`` builds a sampling method (online RL, distillation, online DPO) with
``use_vllm=True`` (the construction's CUDA and vllm-installed checks pass, for that call only) whose ``VLLMRollouts``
callback builds a ``ShiftedPolicyEngine`` per model that samples instead of a real engine (appended to ``engines``;
the module's ``Sampling`` component is handed their samplers at fit start, as with real engines)."""

from __future__ import annotations

import functools
import importlib.util

import torch

EOS_IDS = (0, 2)  # the tiny model's EOS ids: never drawn, so each completion keeps the length drawn for it


def offset(position: int) -> float:
    """How far the engine's log-prob of a completion's token at ``position`` is from the policy's."""
    return (-0.15, 0.25, -0.05)[position % 3]


class ShiftedPolicyEngine:
    """Samples random token ids (from the request's seed, as vLLM does), of random lengths up to ``max_tokens``, and
    reports as the sampler's log-probs the policy's own log-probs of them at the request's temperature shifted by
    ``offset(position)``: a sampler close to the policy but not equal to it, whose log-probs are known. Every
    answer with log-probs is kept in ``answers`` (prompt-major, as vLLM returns them); every answer's token ids in
    ``completions``, and every weight push as (the module's optimizer step, the weights) in ``loads``. ``who``: the
    model it samples for (``SamplingModule.vllm_models``)."""

    def __init__(self, module, who: str = "policy") -> None:
        self.module, self.who = module, who
        self.pushes = 0
        self.answers: list[list[list[float]]] = []
        self.completions: list[list[list[int]]] = []
        self.loads: list[tuple[int, dict[str, torch.Tensor]]] = []

    def load_weights(self, weights, send=True) -> None:
        self.pushes += 1
        self.loads.append((self.module.global_step, {name: tensor.clone() for name, tensor in weights()}))

    @torch.no_grad()
    def generate(self, prompts, params):
        g = torch.Generator().manual_seed(params["seed"])
        completions = []
        for _ in prompts:
            for _ in range(params["n"]):
                length = int(torch.randint(1, params["max_tokens"] + 1, (), generator=g))
                completions.append(torch.randint(3, 200, (length,), generator=g).tolist())
        self.completions.append(completions)
        if "logprobs" not in params:
            return completions, None
        model = self.module.model
        device = next(model.parameters()).device
        logps = []
        for i, ids in enumerate(completions):
            prompt = prompts[i // params["n"]]
            tokens = torch.tensor([prompt + ids], device=device)
            logits = model(input_ids=tokens).logits[0, len(prompt) - 1:-1].float() / params["temperature"]
            own = torch.log_softmax(logits, -1).gather(-1, tokens[0, len(prompt):, None])[:, 0]
            logps.append([float(v) + offset(t) for t, v in enumerate(own)])
        self.answers.append(logps)
        return completions, logps


def vllm_module(cls, monkeypatch, engines: list, *args, **knobs):
    """``cls(*args, use_vllm=True, **knobs)`` on this machine, sampling through a ``ShiftedPolicyEngine``."""
    from lightalign.modules.sampling import vllm_engines
    from lightalign.modules.sampling.vllm import check_vllm_knobs
    from lightalign.modules.sampling import module as sampling_module

    def factory(module, trainer, who="policy", model_path=None):
        engines.append(ShiftedPolicyEngine(module, who))
        return engines[-1]

    class FakeVLLMRollouts(vllm_engines.VLLMRollouts):
        def __init__(self, engine_factory=factory) -> None:
            super().__init__(engine_factory)

    real_find_spec = importlib.util.find_spec
    with monkeypatch.context() as m:  # the checks of use_vllm at construction: a GPU, vllm installed
        m.setattr(sampling_module, "check_vllm_knobs", functools.partial(check_vllm_knobs, cuda_available=True))
        m.setattr(importlib.util, "find_spec",
                  lambda name, *a, **k: object() if name == "vllm" else real_find_spec(name, *a, **k))
        built = cls(*args, use_vllm=True, **knobs)
    monkeypatch.setattr(vllm_engines, "VLLMRollouts", FakeVLLMRollouts)  # what configure_callbacks imports
    return built
