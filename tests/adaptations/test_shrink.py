"""``shrink_config``: real-size configs shrunk in size only, for the probe (modules/adaptations/shrink.py).

On real-size default configs of several families: the shrunk config keeps every layer kind, the rope, the routing
and the dropout-type values, puts each token-count threshold where ``max_tokens`` says (binding: at
``PROBE_THRESHOLD``, inside the probe's sequences; not binding: at 2 x ``PROBE_LENGTH`` or more), keeps LongRoPE's
scaling ratio, and builds a probe model under 3M parameters that runs on ``PROBE_LENGTH`` tokens."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from lightalign.modules.adaptations.shrink import PROBE_LENGTH, PROBE_THRESHOLD, probe_model, shrink_config

_FACTORS = [round(1.0 + i / 48, 4) for i in range(48)]  # 48 = Phi-3-mini's rotary dims / 2: one per frequency
CONFIGS = {  # name -> (model_type, kwargs over the family's real-size defaults)
    "llama": ("llama", {}),
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=4096, max_window_layers=28)),
    "llama4_text": ("llama4_text", {}),  # chunked attention (8192), NoPE every 4th layer, MoE
    "phi3-longrope": ("phi3", dict(max_position_embeddings=131072, original_max_position_embeddings=4096,
                                   rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                        short_factor=_FACTORS, long_factor=[4 * f for f in _FACTORS]))),
    "lfm2": ("lfm2", dict(num_hidden_layers=16, layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv"
                                                             for i in range(16)])),
    "granitemoehybrid": ("granitemoehybrid", dict(layer_types=["full_attention" if i % 10 == 5 else "linear_attention"
                                                               for i in range(32)])),
    "gpt_neo": ("gpt_neo", {}),  # local attention (window 256) in every other layer, learned positions
    "mixtral": ("mixtral", dict(router_jitter_noise=0.1)),
}
THRESHOLDS = {"qwen2-sliding": ("sliding_window", 4096), "llama4_text": ("attention_chunk_size", 8192),
              "gpt_neo": ("window_size", 256), "phi3-longrope": ("original_max_position_embeddings", 4096)}
KIND_FIELDS = ("layer_types", "attention_layers", "no_rope_layers", "mlp_layer_types", "layers_block_type")


def real_config(name: str):
    from transformers import AutoConfig

    model_type, kwargs = CONFIGS[name]
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager" if model_type == "gpt_neo" else "sdpa"  # as from_pretrained picks
    return config


@functools.cache
def shrunk(name: str, max_tokens: int | None = None):
    return shrink_config(real_config(name), max_tokens)


def _model_class(config):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_shrunk_model_is_tiny_and_runs(name):
    config, facts = shrunk(name)
    model = probe_model(_model_class(config), config)
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    assert not model.training and next(model.parameters()).dtype == torch.float32
    ids = torch.randint(3, 200, (1, PROBE_LENGTH), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    json.dumps(facts)  # a cache key
    assert facts["model_type"] == real_config(name).model_type


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layers_fewer_but_every_kind_kept(name):
    real, (small, facts) = real_config(name), shrunk(name)
    assert 2 <= small.num_hidden_layers < real.num_hidden_layers
    assert facts["layers"]["from"] == real.num_hidden_layers and facts["layers"]["to"] == small.num_hidden_layers
    for key in KIND_FIELDS:
        if isinstance(getattr(real, key, None), list):
            assert len(getattr(small, key)) == small.num_hidden_layers, key
            assert set(map(str, getattr(small, key))) == set(map(str, getattr(real, key))), key


@pytest.mark.parametrize("name", list(CONFIGS))
def test_attention_rope_routing_and_dropout_kept(name):
    real, (small, _) = real_config(name), shrunk(name)
    assert small._attn_implementation == real._attn_implementation
    assert small.hidden_size < real.hidden_size and small.vocab_size <= 256
    for key in ("rope_type", "rope_theta", "partial_rotary_factor"):
        rope, small_rope = getattr(real, "rope_parameters", None) or {}, getattr(small, "rope_parameters", None) or {}
        assert rope.get(key) == small_rope.get(key), key
    for key in ("num_experts_per_tok", "router_jitter_noise", "norm_topk_prob", "attention_dropout", "resid_dropout",
                "embed_dropout", "use_sliding_window", "max_window_layers", "interleave_moe_layer_step",
                "attn_temperature_tuning", "mamba_d_conv", "conv_L_cache", "use_qk_norm"):
        if hasattr(real, key):
            assert getattr(small, key) == getattr(real, key), key
    if getattr(real, "num_local_experts", None):
        assert real.num_experts_per_tok < small.num_local_experts < real.num_local_experts
    heads, kv = small.num_attention_heads, getattr(small, "num_key_value_heads", None) or small.num_attention_heads
    assert heads % kv == 0


@pytest.mark.parametrize("name", list(THRESHOLDS))
def test_thresholds_follow_max_tokens(name):
    key, value = THRESHOLDS[name]
    for max_tokens, binds in ((None, True), (value + 1, True), (value, False), (64, False)):
        small, facts = shrunk(name, max_tokens)
        assert facts[key] == {"value": value, "binds": binds}, max_tokens
        if binds:
            assert getattr(small, key) == PROBE_THRESHOLD < PROBE_LENGTH
        else:
            assert getattr(small, key) >= 2 * PROBE_LENGTH


@pytest.mark.parametrize("max_tokens", [None, 1000])
def test_longrope_keeps_its_ratio_and_factors(max_tokens):
    real, (small, _) = real_config("phi3-longrope"), shrunk("phi3-longrope", max_tokens)
    rope = small.rope_parameters
    assert rope["rope_type"] == "longrope"
    assert rope["original_max_position_embeddings"] == small.original_max_position_embeddings
    assert small.max_position_embeddings / small.original_max_position_embeddings == 131072 / 4096
    step = real.hidden_size // real.num_attention_heads // (small.hidden_size // small.num_attention_heads)
    assert rope["short_factor"] == _FACTORS[::step] and len(rope["short_factor"]) < len(_FACTORS)
    assert rope["long_factor"] == [4 * f for f in _FACTORS][::step]


def test_gpt_neo_keeps_local_and_global_layers():
    small, _ = shrunk("gpt_neo")
    assert set(small.attention_layers) == {"global", "local"}
    assert sum(n for _, n in small.attention_types) * len(small.attention_types[0][0]) == small.num_layers


def test_special_token_ids_moved_into_the_vocabulary():
    from transformers import AutoConfig

    real = AutoConfig.for_model("llama", bos_token_id=128000, eos_token_id=[128001, 128009], pad_token_id=5)
    small, _ = shrink_config(real, None)
    ids = [small.bos_token_id, *small.eos_token_id, small.pad_token_id]
    assert all(0 <= i < small.vocab_size for i in ids) and len(set(ids)) == 4 and small.pad_token_id == 5


def test_never_builds_the_real_size_model(monkeypatch):
    sizes = []
    init = torch.nn.Linear.__init__

    def spy(self, in_features, out_features, *args, **kwargs):
        sizes.append(in_features * out_features)
        init(self, in_features, out_features, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Linear, "__init__", spy)
    shrink_config(real_config("llama"), None)
    assert sizes and max(sizes) < 1_000_000


def test_probe_model_is_seeded_without_touching_the_global_rng():
    config, _ = shrunk("llama")
    state = torch.random.get_rng_state()
    a, b, c = (probe_model(_model_class(config), config, seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), state)
    weights = [m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


def test_vision_language_config_shrinks_with_its_tower():
    """A Qwen2.5-VL-3B-sized config: the tower's token and position settings (patch, merge, temporal patch, pixel
    window) and its kinds of blocks (full-attention indexes, in order) are kept, its output width follows the
    shrunk language model, mRoPE sections still split the rotary half, and the probe builds small."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, intermediate_size=11008,
                num_hidden_layers=36, rope_parameters=dict(rope_type="default", mrope_section=[16, 24, 24],
                                                           rope_theta=1e6))
    config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(out_hidden_size=2048))
    shrunk, facts = shrink_config(config, None, model_class=Qwen2_5_VLForConditionalGeneration)
    v, t = shrunk.vision_config, shrunk.text_config
    for key in ("patch_size", "spatial_merge_size", "temporal_patch_size", "window_size", "in_channels"):
        assert getattr(v, key) == getattr(config.vision_config, key), key
    assert v.depth < config.vision_config.depth and len(v.fullatt_block_indexes) == 4
    assert v.fullatt_block_indexes[-1] == v.depth - 1  # the last block is a full-attention one, as in the real tower
    assert v.out_hidden_size == t.hidden_size < 2048 and v.hidden_size < config.vision_config.hidden_size
    head_dim = t.hidden_size // t.num_attention_heads
    assert 2 * sum(t.rope_parameters["mrope_section"]) == head_dim
    model = probe_model(Qwen2_5_VLForConditionalGeneration, shrunk)
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
