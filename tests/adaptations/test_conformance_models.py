"""The tests' model catalogue (tests/helpers/conformance_models.py): every family builds tiny, runs, and has what it is
there for (windows and chunks that bind on test sequences, several layer kinds in each hybrid, dropout-type values
only in the dedicated variants)."""

from __future__ import annotations

import pytest
import torch

from helpers.conformance_models import _DROPOUT, DROPOUT_VARIANTS, FAMILIES, VOCAB, WINDOW, build, config

PARAM_CAP = 300_000
SEQUENCE = 24  # the longest test sequences are about this long
THRESHOLDS = ("sliding_window", "window_size", "attention_chunk_size", "attention_window_size")
HYBRIDS = ("lfm2", "lfm2_moe", "granitemoehybrid", "bamba", "nemotron_h", "zamba2", "qwen3_next", "recurrent_gemma",
           "llama4-chunked", "gpt_neo")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_catalogue_covers_the_families():
    model_types = {model_type for model_type, _ in FAMILIES.values()}
    assert len(model_types) >= 40, sorted(model_types)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_builds_tiny_and_runs(name):
    model = build(name)
    assert sum(p.numel() for p in model.parameters()) < PARAM_CAP
    assert not model.training
    ids = torch.randint(3, VOCAB, (2, SEQUENCE), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert logits.shape == (2, SEQUENCE, VOCAB)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_dropout_type_values_only_in_the_variants(name):
    values = {k: v for k, v in config(name).to_dict().items() if _DROPOUT.search(k) and isinstance(v, float) and v}
    assert bool(values) == (name in DROPOUT_VARIANTS), values


def _windowed():
    return [(name, key) for name in FAMILIES for key in THRESHOLDS if config(name).to_dict().get(key) == WINDOW]


@pytest.mark.parametrize(("name", "key"), _windowed())
def test_window_binds_on_test_sequences(name, key):
    """The same weights with the window / chunk widened: equal logits inside the window, other logits past it."""
    from transformers import AutoModelForCausalLM

    model = build(name)
    wide = config(name)
    setattr(wide, key, 10_000)
    torch.manual_seed(0)
    wide_model = AutoModelForCausalLM.from_config(wide, attn_implementation=model.config._attn_implementation,
                                                  dtype=torch.float32).eval()
    wide_model.load_state_dict(model.state_dict())
    ids = torch.randint(3, VOCAB, (1, SEQUENCE), generator=torch.Generator().manual_seed(1))
    narrow, widened = _logits(model, ids), _logits(wide_model, ids)
    torch.testing.assert_close(narrow[:, : WINDOW - 1], widened[:, : WINDOW - 1])
    assert not torch.allclose(narrow[:, -1], widened[:, -1], atol=1e-4)


def test_longrope_switches_inside_test_sequences():
    """phi3-longrope: a sequence past original_max_position_embeddings (16) runs on the long factors, so its
    first tokens get other logits than the same tokens alone."""
    model = build("phi3-longrope")
    assert model.config.rope_parameters["rope_type"] == "longrope"
    ids = torch.randint(3, VOCAB, (1, SEQUENCE), generator=torch.Generator().manual_seed(2))
    short, long = _logits(model, ids[:, :12]), _logits(model, ids)
    assert not torch.allclose(short, long[:, :12], atol=1e-4)
    torch.testing.assert_close(_logits(model, ids[:, :8]), short[:, :8])  # both under 16: same factors


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrids_mix_layer_kinds(name):
    cfg = config(name)
    kinds = next(getattr(cfg, key) for key in ("layer_types", "layers_block_type", "block_types", "attention_layers")
                 if getattr(cfg, key, None))
    assert len(set(kinds)) >= 2, kinds
