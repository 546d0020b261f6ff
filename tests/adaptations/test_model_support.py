"""The cases a static support table got silently wrong (transformers 5.24), each decided by the probe now.

Each test builds a tiny model of the class, shows the problem is real on that model (the layout computed anyway
is off, or a train-mode forward is random), and checks lightalign refuses (or warns) by measurement. Mutation
that fails every test here: ``probe._measure`` returning an exact verdict without measuring (or
``support.check_layout`` skipping ``measured``); each test names its own as well.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightalign.modules.adaptations import LayoutRefused, adapt_model, check_layout
from lightalign.modules.adaptations import probe_layouts as pl
from lightalign.modules.adaptations.probe import unit_scale

LONG = ((9, 13, 7), (4, 3, 5), (15, 6, 11))


def tiny(model_type: str, **kwargs) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    config = AutoConfig.for_model(model_type, **{**base, **kwargs})
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return unit_scale(model, seed=3)  # unit-scale weights: a leak moves log-probs by O(1)


def off_by(layout: str, model, lengths=LONG) -> float:
    adapted = copy.deepcopy(model)
    adapt_model(adapted)
    seqs = pl.probe_sequences(512, lengths, 8, seed=5)
    return pl.max_difference(pl.layout_logps(layout, adapted, seqs), pl.alone_logps(layout, model, seqs))


@pytest.mark.parametrize("layout", ["packed", "dpo_shared", "grpo_packed"])
def test_short_convolution_hybrid_is_refused_where_sequences_would_mix(layout):
    """LFM2's conv layers ignore attention masks: packed and shared-prefix rows leak across sequences."""
    model = tiny("lfm2", layer_types=["conv", "full_attention"])
    assert off_by(layout, model) > 1e-2  # the leak is real on this model
    adapted = copy.deepcopy(model)
    adapt_model(adapted)
    with pytest.raises(LayoutRefused, match=r"Lfm2ForCausalLM.*nats.*\['conv'\] are not attention"):
        check_layout(adapted, layout)
    check_layout(adapted, "padded")  # what the refusal points to is exact
    check_layout(adapted, "dpo_classic")


def test_chunked_attention_is_refused_for_packed_and_shared_rows():
    """Llama 4's chunked attention (chunks of 8 tokens here) is lost by a packed or shared-prefix mask."""
    model = tiny("llama4_text", attention_chunk_size=8, no_rope_layers=[1, 0], num_local_experts=2, head_dim=8,
                 intermediate_size_mlp=64)
    adapted = copy.deepcopy(model)
    adapt_model(adapted)
    for layout in ("packed", "dpo_shared"):
        assert off_by(layout, model) > 1e-2
        with pytest.raises(LayoutRefused, match="chunks of 8 tokens"):
            check_layout(adapted, layout)
    # sequences that never reach a chunk edge: the chunking never binds, the layout is exact
    assert check_layout(adapted, "packed", max_tokens=8).exact


def test_longrope_batch_dependence_is_said_with_its_size():
    """Phi-3 LongRoPE picks its rope factors from the longest position of the forward: a padded batch mixing short
    and long sequences differs from each alone, whatever the layout. Said once, with the measured size."""
    from lightalign.modules.adaptations.support import batch_dependence_note

    model = tiny("phi3", original_max_position_embeddings=16, max_position_embeddings=64, pad_token_id=0,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [3.0] * 4})
    assert off_by("padded", model) > 1e-3  # real on the model itself
    adapted = copy.deepcopy(model)
    adapt_model(adapted)
    verdict = check_layout(adapted, "packed")
    assert verdict.exact and verdict.batch_dependence > 1e-3
    note = batch_dependence_note(adapted, verdict)
    assert "Phi3ForCausalLM" in note and f"{verdict.batch_dependence:.1e}" in note and "max_length" in note
    assert "original_max_position_embeddings 16" in note
    # runs that stay under the threshold: no dependence measured, nothing to say
    short = check_layout(adapted, "packed", max_tokens=16)
    assert short.batch_dependence == 0 and batch_dependence_note(adapted, short) is None


@pytest.mark.slow
def test_static_cache_on_gpt_neo_local_attention_is_refused():
    """The static backend's cache ignores GPT-Neo's local window: its greedy tokens are not the policy's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_neo", vocab_size=512, hidden_size=32, num_layers=2, num_heads=4,
                                  attention_types=[[["global", "local"], 1]], window_size=6,
                                  max_position_embeddings=256)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.raises(LayoutRefused, match=r"generation_backend: static.*GPTNeoForCausalLM.*greedy tokens differ"):
        check_layout(model, "static")
    check_layout(model, "compact")  # compact keeps the window: exact


def test_hybrid_default_rollout_refuses_shared_prefill_by_name(tmp_path, tiny_dir):
    """GRPO on LFM2: the CPU default (compact) cannot serve its conv cache and steps back to generate, said in the
    fit-start note; the default shared prefill then fails on the probe (its conv cache cannot be repeated) and is
    refused naming model.share_prefill, instead of an AttributeError inside the first rollout."""
    from lightalign import GRPOModule
    from lightalign.hub import load_tokenizer
    from lightalign.rewards import digit_fraction_reward

    folder = tmp_path / "lfm2"
    tiny("lfm2", layer_types=["conv", "full_attention"]).save_pretrained(folder)
    load_tokenizer(str(tiny_dir)).save_pretrained(folder)
    module = GRPOModule(str(folder), reward_funcs=[digit_fraction_reward], num_generations=2)
    module.configure_model()
    with pytest.raises(LayoutRefused, match=r"model\.share_prefill.*Lfm2ForCausalLM.*model\.share_prefill: false"):
        module.sampling_backend()
    module = GRPOModule(str(folder), reward_funcs=[digit_fraction_reward], num_generations=2, share_prefill=False)
    module.configure_model()
    assert module.sampling_backend() == "generate"
    assert "not the device's default: generation_backend 'compact' cannot sample from 'lfm2'" in module.sampling_note
    # one completion per prompt (PPO's default) shares no prefill: nothing to refuse (mutation: measure it anyway)
    from lightalign import PPOModule

    module = PPOModule(str(folder), reward_funcs=[digit_fraction_reward])
    module.configure_model()
    assert module.sampling_backend() == "generate"


@pytest.mark.parametrize("model_type, kwargs, mutation", [
    ("falcon", dict(hidden_dropout=0.3, attention_dropout=0.3, alibi=False), "config"),  # read from the config
    ("mixtral", dict(router_jitter_noise=0.5, num_local_experts=4, num_experts_per_tok=2), "jitter"),
])
def test_train_mode_randomness_left_on_is_caught_by_the_measurement(model_type, kwargs, mutation, monkeypatch):
    """With disable_dropout, the probe's two train-mode forwards must agree. The mechanism is broken on purpose
    (config fields not zeroed / jitter not recognised): the measurement refuses the run, naming the model."""
    from types import SimpleNamespace

    from lightalign.modules.training import dropout
    from lightalign.modules.training.policy import PolicyModule

    model = tiny(model_type, **kwargs)
    real_is_rate = dropout._is_rate
    if mutation == "config":
        real_configs = dropout._configs
        monkeypatch.setattr(dropout, "_configs", lambda m: [])  # config-read rates left on
    else:
        monkeypatch.setattr(dropout, "_is_rate", lambda name, value: "jitter" not in name and real_is_rate(name, value))
    report = dropout.disable_dropout_in_model(model)
    holder = SimpleNamespace(model=model, dropout_report=report)
    with pytest.raises(ValueError, match=r"disable_dropout is on, but .*ForCausalLM.* still random in train mode"):
        PolicyModule.check_train_determinism(holder)
    monkeypatch.undo()  # the real switch: deterministic, measured
    model = tiny(model_type, **kwargs)
    holder = SimpleNamespace(model=model, dropout_report=dropout.disable_dropout_in_model(model))
    assert "deterministic" in PolicyModule.check_train_determinism(holder)
    if mutation == "config":
        assert real_configs is dropout._configs


def test_a_refused_layout_is_refused_before_the_weights_load(tmp_path, tiny_dir, data_dir, quiet_trainer, monkeypatch):
    """DPO's default prompt sharing on LFM2: refused from the model's class and config (built on the meta device),
    before load_causal_lm reads any weight. Mutation: drop check_layout_before_loading -> the weights load first."""
    import lightalign.modules.training.model_building as base
    from lightalign import DPOModule, PreferenceDataModule
    from lightalign.hub import load_tokenizer

    folder = tmp_path / "lfm2"
    tiny("lfm2", layer_types=["conv", "full_attention"]).save_pretrained(folder)
    load_tokenizer(str(tiny_dir)).save_pretrained(folder)
    monkeypatch.setattr(base, "load_causal_lm", lambda *a, **kw: pytest.fail("weights loaded before the refusal"))
    module = DPOModule(str(folder))
    data = PreferenceDataModule(str(data_dir / "arithmetic_preference.jsonl"), tokenizer=str(folder), max_length=64,
                                batch_size=4)
    with pytest.raises(LayoutRefused, match=r"data\.prompt_sharing .*Lfm2ForCausalLM.*prompt_sharing: false"):
        quiet_trainer(max_steps=1).fit(module, data)
    assert module.model is None
