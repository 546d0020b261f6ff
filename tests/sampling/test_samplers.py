"""The sampler interface (modules/sampling/samplers.py): one call signature, refusals at construction naming the
backend, the knob and one that serves it, and a sampler's error reaching the user (no backend swapped in)."""

from __future__ import annotations

import inspect

import pytest

from lightalign import PPOModule, RLOOModule
from lightalign.modules.sampling.samplers import SAMPLERS, Sampler, get_sampler


def test_every_sampler_has_the_interface_signature():
    reference = inspect.signature(Sampler.sample)
    from lightalign.modules.sampling.vllm_engines import VLLMSampler

    for cls in [*SAMPLERS.values(), VLLMSampler]:
        assert issubclass(cls, Sampler)
        assert list(inspect.signature(cls.sample).parameters) == list(reference.parameters), cls.name


@pytest.mark.parametrize("backend, knobs, knob", [
    ("continuous", dict(repetition_penalty=1.1), "repetition_penalty"),
    ("continuous", dict(generation_kwargs={"no_repeat_ngram_size": 2}), "generation_kwargs"),
    ("compact", dict(generation_kwargs={"no_repeat_ngram_size": 2}), "generation_kwargs"),
    ("compact", dict(cache_implementation="static", share_prefill=False), "cache_implementation"),
    ("static", dict(cache_implementation="static", share_prefill=False), "cache_implementation"),
])
@pytest.mark.parametrize("method", ["grpo", "rloo", "ppo"])
def test_a_knob_the_backend_cannot_honour_is_refused_at_construction(grpo_module, tiny_dir, method, backend, knobs,
                                                                      knob):
    from lightalign.rewards import digit_fraction_reward

    build = {"grpo": grpo_module,
             "rloo": lambda **kw: RLOOModule(str(tiny_dir), from_config=True, reward_funcs=[digit_fraction_reward], **kw),
             "ppo": lambda **kw: PPOModule(str(tiny_dir), from_config=True, reward_funcs=[digit_fraction_reward], **kw)}
    with pytest.raises(ValueError, match=f"generation_backend '{backend}' cannot honour {knob} .*use "
                                         "generation_backend: generate"):
        build[method](generation_backend=backend, **knobs)
    build[method](generation_backend="generate", **knobs)  # the backend named as the alternative serves it


def test_unknown_backend_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"generation_backend='beam' is unknown; use one of \['generate', "):
        get_sampler("beam")


@pytest.mark.parametrize("backend", [None, "compact", "generate"])
def test_a_sampler_error_is_an_error(grpo_module, prompt_data, quiet_trainer, monkeypatch, backend):
    """A sampler that raises stops the run with its own error: no other backend is swapped in (the mutation: a
    catch-all fallback to generate in the rollout makes this fail)."""
    import lightalign.modules.sampling.compact as compact
    import lightalign.modules.sampling.generate as generate

    calls = []
    module = grpo_module(generation_backend=backend, generation_batch_size=8)

    def breaks_on_the_policy(real):  # the fit-start probe (a shrunk copy of the model) samples as usual
        def sample(model, *args, **kwargs):
            if model is not module.model:
                return real(model, *args, **kwargs)
            calls.append(1)
            raise RuntimeError("sampler bug")
        return sample

    monkeypatch.setattr(compact, "compact_groups", breaks_on_the_policy(compact.compact_groups))
    monkeypatch.setattr(generate, "generate_groups", breaks_on_the_policy(generate.generate_groups))
    with pytest.raises(RuntimeError, match="sampler bug"):
        quiet_trainer(max_steps=1).fit(module, prompt_data())
    assert len(calls) == 1  # raised once, and nothing sampled again on another backend


@pytest.mark.parametrize("knobs, message", [
    (dict(max_completion_length=0), "max_completion_length must be >= 1"),
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(temperature=-1.0), "temperature must be > 0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(generation_backend="continuous", cache_implementation="static"), "'continuous' cannot honour "
                                                                            "cache_implementation"),
])
def test_sampling_knobs_out_of_range_are_refused_at_construction(grpo_module, knobs, message):
    with pytest.raises(ValueError, match=message):
        grpo_module(**knobs)


def test_an_asked_one_process_backend_is_refused_at_fit_start_under_several_processes(grpo_module, monkeypatch):
    import lightalign.modules.sampling.samplers as samplers

    module = grpo_module(generation_backend="compact")
    module.configure_model()
    monkeypatch.setattr(samplers, "several_processes", lambda: True)
    with pytest.raises(ValueError, match="'compact' is not supported with several processes"):
        module.sampling_backend()


@pytest.mark.parametrize("method", ["GRPOModule", "RLOOModule", "PPOModule", "DistillModule", "OnlineDPOModule"])
def test_neftune_is_not_a_knob_of_the_sampling_methods(tiny_dir, method):
    """NEFTune's noise is in train-mode forwards only: on sampled completions the training forward would carry noise
    their log-probs did not. Only the supervised methods take the knob; the others name them."""
    import inspect

    import lightalign
    from lightalign.rewards import digit_fraction_reward

    cls = getattr(lightalign, method)
    assert "neftune_noise_alpha" not in inspect.signature(cls).parameters  # nor in --model.help
    knobs = dict(reward_funcs=[digit_fraction_reward]) if method != "DistillModule" else dict(
        teacher_model_name_or_path=str(tiny_dir))
    with pytest.raises(TypeError, match=f"{method} has no knob 'neftune_noise_alpha'; CPOModule, DPOModule, KTOModule, ORPOModule, "
                                        "RewardModule and SFTModule take it"):
        cls(str(tiny_dir), from_config=True, neftune_noise_alpha=5.0, **knobs)
