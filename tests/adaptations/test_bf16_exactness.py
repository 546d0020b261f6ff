"""Layouts are exact in bf16 too: a run under ``bf16-mixed`` has its layout measured under the same CPU autocast
Lightning enters, against each sequence's own bf16 forward, within ``bf16_tolerance`` (twice bf16's own measured
effect on that forward, plus the float32 tolerance).

Mutations that fail this file: ``computing_in`` not entering autocast (bf16's effect is 0: the exact tests fail);
the precision dropped from the cache key (a float32 verdict read back as the bf16 one, and the reverse); a window
dropped / a sequence boundary or the shared-prefix mask broken under bf16 only (the verdict must say not exact,
by many times the tolerance); ``check_layout`` ignoring ``precision`` (the broken bf16 layout is accepted).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from helpers import console_script

from lightalign.modules.adaptations import LayoutRefused, adapt_model, check_layout
from lightalign.modules.adaptations.attention import VARLEN_SDPA, varlen_sdpa_forward
from lightalign.modules.adaptations.probe import TOLERANCE, measure
from lightalign.modules.adaptations.probe_precision import bf16_tolerance, probe_precision

# the bf16 verdict of a layout broken by a leak is many times its tolerance, not a near miss
MARGIN = 20


def _model(tiny_dir, **config) -> torch.nn.Module:
    """The shipped tiny model's class and config (random weights: the probe redraws them anyway), adapted as a run
    adapts it (``sdpa_varlen``)."""
    cfg = AutoConfig.from_pretrained(tiny_dir)
    for k, v in config.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    adapt_model(model)
    return model


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setenv("LIGHTALIGN_PROBE_CACHE", "0")  # measure, never read a verdict


def test_probe_precision_follows_lightning_names():
    assert [probe_precision(p) for p in ("bf16-mixed", "bf16", "bf16-true", "32-true", "16-mixed", None)] == [
        "bf16-mixed", "bf16-mixed", "bf16-true", "32", "32", "32"]


@pytest.mark.parametrize("layout", ["padding_free", "packed", "dpo_shared"])
def test_layouts_are_exact_in_bf16_within_the_derived_tolerance(tiny_dir, fresh_probe, layout):
    model = _model(tiny_dir)
    verdict = check_layout(model, layout, precision="bf16-mixed")
    assert verdict.precision == "bf16-mixed" and verdict.exact
    # bf16 was in effect (a float32 forward would move nothing) and the tolerance is the derived one
    assert verdict.precision_effect > 1e-3
    assert verdict.tolerance == bf16_tolerance(verdict.precision_effect, TOLERANCE) == 2 * verdict.precision_effect + TOLERANCE
    assert verdict.difference <= verdict.tolerance


def test_bf16_true_weights_are_measured_too(tiny_dir, fresh_probe):
    verdict = measure(_model(tiny_dir), "padding_free", precision="bf16-true")
    assert verdict.precision == "bf16-true" and verdict.exact and verdict.precision_effect > 1e-3


def test_verdicts_are_cached_per_precision(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTALIGN_CACHE_DIR", str(tmp_path))
    model = _model(tiny_dir)
    first = measure(model, "packed", precision="bf16-mixed")  # measures float32, then bf16: two files
    assert not first.cached and first.precision == "bf16-mixed"
    assert len(list(tmp_path.rglob("*.json"))) == 2
    again, fp32 = measure(model, "packed", precision="bf16-mixed"), measure(model, "packed")
    assert again.cached and again.precision == "bf16-mixed" and again.tolerance == first.tolerance
    assert fp32.cached and fp32.precision == "32" and fp32.tolerance == TOLERANCE


def _broken_in_bf16(monkeypatch, how: str) -> None:
    """``sdpa_varlen`` broken under bf16 autocast only (float32 forwards unchanged): ``window`` attends past the sliding
    window; ``boundary`` runs a packed row as one sequence (attention crosses the sequences); ``mask`` gives a
    shared-prefix row a plain causal mask (the rejected branch sees the chosen one)."""

    def broken(module, query, key, value, attention_mask, *args, **kwargs):
        if torch.is_autocast_enabled("cpu"):
            if how == "window":
                kwargs.pop("sliding_window", None)
                module = copy.copy(module)
                module.sliding_window = None
            elif how == "boundary" and kwargs.get("sequence_sizes"):
                kwargs["sequence_sizes"] = [sum(kwargs["sequence_sizes"])]
            elif how == "mask" and attention_mask is not None and attention_mask.dim() == 4:
                attention_mask = torch.ones_like(attention_mask).tril()
        return varlen_sdpa_forward(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, VARLEN_SDPA, broken)


@pytest.mark.parametrize("layout, how, config", [
    ("packed", "window", {"sliding_window": 6, "use_sliding_window": True, "max_window_layers": 0,
                          "layer_types": ["sliding_attention"] * 4}),
    ("padding_free", "boundary", {}),
    ("dpo_shared", "mask", {}),
], ids=["packed-window", "padding_free-boundary", "dpo_shared-mask"])
def test_a_layout_broken_only_in_bf16_is_refused_naming_the_precision(tiny_dir, fresh_probe, monkeypatch, layout,
                                                                      how, config):
    model = _model(tiny_dir, **config)
    _broken_in_bf16(monkeypatch, how)
    assert measure(model, layout).exact  # float32 is untouched by the mutation
    verdict = measure(model, layout, precision="bf16-mixed")
    assert not verdict.exact and verdict.precision == "bf16-mixed"
    assert verdict.difference > MARGIN * verdict.tolerance, (verdict.difference, verdict.tolerance)
    with pytest.raises(LayoutRefused) as refused:
        check_layout(model, layout, precision="bf16-mixed")
    message = str(refused.value)
    assert "trainer.precision bf16-mixed" in message and "trainer.precision: 32-true" in message
    assert f"{verdict.difference:.1e} nats" in message and "exact in float32" in message
    assert {"packed": "data.packing: false", "padding_free": "data.padding_free: false",
            "dpo_shared": "data.prompt_sharing: false"}[layout] in message


def test_the_console_script_measures_a_bf16_runs_layout_in_bf16(repo, tmp_path):
    """The shipped quickstart config, packed, under ``--trainer.precision bf16-mixed``: the fit-start line says the
    packed layout was judged in bf16 (``trainer.precision`` reaches the probe through the CLI's trainer)."""
    proc = console_script.run(repo, "fit", "--config", "configs/quickstart.yaml", "--trainer.precision", "bf16-mixed",
                              "--data.packing", "true", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                              "--trainer.limit_val_batches", "1", "--data.batch_size", "4",
                              "--checkpoint.every_n_train_steps", "2", "--trainer.logger.init_args.save_dir",
                              str(tmp_path), timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "layout packed (exact, in bf16-mixed within" in out, out[-4000:]
