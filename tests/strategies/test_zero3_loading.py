"""Under ZeRO-3 (the strategy registers its DeepSpeed config with transformers for the whole run) a separately
loaded reference and a reward model still load whole: DeepSpeed never wraps them, so a partition would stay
empty. One process: with the config registered and no process group, a partitioned load cannot even start."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from lightalign.modules.reference.model import build_reference


@contextmanager
def zero3_registered():
    """What ``DeepSpeedZeroStrategy`` leaves registered with transformers for the run (ZeRO-3)."""
    pytest.importorskip("deepspeed")
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    try:
        yield is_deepspeed_zero3_enabled
    finally:
        del config
        unset_hf_deepspeed_config()


def test_separate_reference_loads_whole_under_zero3(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path / "ref")
    with zero3_registered() as zero3_enabled:
        ref = build_reference(tiny_model, str(tmp_path / "ref"), separate=True)
        assert zero3_enabled()  # the run's registration is back for the policy's generate
    expected = tiny_model.state_dict()
    for name, value in ref.state_dict().items():
        assert value.shape == expected[name].shape and torch.equal(value, expected[name]), name


def test_reward_model_loads_whole_under_zero3(tiny_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from lightalign.hub import load_tokenizer
    from lightalign.rewards import RewardModel

    config = AutoConfig.from_pretrained(str(tiny_dir), num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    saved = AutoModelForSequenceClassification.from_config(config)
    saved.save_pretrained(tmp_path / "rm")
    load_tokenizer(str(tiny_dir)).save_pretrained(tmp_path / "rm")
    with zero3_registered() as zero3_enabled:
        model = RewardModel(str(tmp_path / "rm"), device="cpu").load().model
        assert zero3_enabled()
    for name, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_the_probe_shrinks_the_model_plainly_under_zero3(tiny_model, monkeypatch):
    """At each fit start the adaptation probe builds the shrunk model's structure to count its parameters: a plain
    model under ZeRO-3 too (partitioned, every build is collectives on every rank, and it counts 0 parameters)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    from lightalign.modules.adaptations import probe, shrink

    seen, real = [], shrink._structure

    def structure(model_class, config):
        model = real(model_class, config)
        seen.append((is_deepspeed_zero3_enabled(), model is not None))
        return model

    class Shrunk(Exception):
        pass

    def key(*args):  # the shrink is what is checked: stop before the cache lookup (and any measurement)
        raise Shrunk

    monkeypatch.setattr(shrink, "_structure", structure)
    monkeypatch.setattr(probe, "_key", key)
    with zero3_registered() as zero3_enabled:
        with pytest.raises(Shrunk):
            probe.measure(tiny_model, "padded")
        assert zero3_enabled()  # the run's registration is back
    assert seen and all(s == (False, True) for s in seen), seen  # plain, and built (no process group needed)
