"""``disable_dropout``: after ``disable_dropout_in_model`` a model's train-mode forward is deterministic on every
family whose randomness lives somewhere else than ``nn.Dropout`` (config fields read at forward time, layer drop,
MoE router jitter), eval mode is untouched, and the export keeps the user's config values.

Each case first shows that its two train-mode forwards differ (> 1e-4), so the case does exercise its mechanism;
the comment beside it names the change to ``modules/training/dropout.py`` that makes it fail.
"""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch

from lightalign.modules.training.dropout import disable_dropout_in_model, train_mode_nondeterminism, user_dropout_config

VOCAB = 1024
_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)
_MOE = dict(_DECODER, num_local_experts=4, num_experts_per_tok=2)

# name -> (model_type, config kwargs, what the report must name as zeroed); the comment: the mutation that fails it
CASES = {
    # delete the config-field zeroing -> fails (Falcon's decoder layer reads config.hidden_dropout at forward time)
    "falcon": ("falcon", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              alibi=False, hidden_dropout=0.3, attention_dropout=0.3),
               ["config.hidden_dropout", "config.attention_dropout"]),
    # delete the config-field zeroing -> fails (the attention reads config.attention_dropout at forward time)
    "persimmon": ("persimmon", dict(_DECODER, attention_dropout=0.3), ["config.attention_dropout"]),
    # match only names ending in "dropout" (the old rule) -> fails (OPTDecoder.layerdrop skips layers at random)
    "opt": ("opt", dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                        word_embed_proj_dim=32, max_position_embeddings=128, dropout=0.0, layerdrop=0.5),
            ["layerdrop", "config.layerdrop"]),
    # drop "jitter" from the name rule -> fails (MixtralSparseMoeBlock.jitter_noise scales the router input)
    "mixtral": ("mixtral", dict(_MOE, sliding_window=None, router_jitter_noise=0.5),
                ["jitter_noise", "config.router_jitter_noise"]),
    # drop "jitter" from the name rule -> fails (PhiMoE's input_jitter_noise; its routing threshold is 0 here, the
    # case where its expert sampling is deterministic: see test_phimoe_routing_threshold_is_not_noise)
    "phimoe": ("phimoe", dict(_MOE, input_jitter_noise=0.5, router_jitter_noise=0.0),
               ["input_jitter_noise", "config.input_jitter_noise"]),
    # delete the module-attribute zeroing -> fails (LlamaAttention copied attention_dropout from the config at init)
    "llama": ("llama", dict(_DECODER, attention_dropout=0.3), ["attention_dropout"]),
    # delete the nn.Dropout zeroing -> fails (GPT-2's residual, embedding and attention dropouts are modules)
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.3,
                          embd_pdrop=0.3, attn_pdrop=0.3), ["nn.Dropout"]),
}


def _build(model_type: str, kwargs: dict, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **kwargs)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def _eval_logits(model: torch.nn.Module) -> torch.Tensor:
    training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_ids()).logits
    model.train(training)
    return logits


@pytest.mark.parametrize("name", list(CASES))
def test_train_mode_is_deterministic_after_disable_dropout(name):
    model_type, kwargs, named = CASES[name]
    model = _build(model_type, kwargs)
    ids = _ids()
    eval_before = _eval_logits(model)
    assert train_mode_nondeterminism(model, ids) > 1e-4  # the case exercises its mechanism

    report = disable_dropout_in_model(model)
    assert train_mode_nondeterminism(model, ids) == 0.0
    assert torch.equal(_eval_logits(model), eval_before)  # eval mode never used any of it
    assert set(named) <= set(report.zeroed), report.zeroed
    assert report.kept == [] or name == "phimoe"


def test_phimoe_routing_threshold_is_not_noise():
    """PhiMoE's ``router_jitter_noise`` is the sparsemixer's routing threshold, used in eval mode too: it is kept
    (eval logits stay bitwise the same), the report says PhiMoE still samples its experts in train mode, and the
    measurement sees it (what the layout probe refuses a ``disable_dropout`` run on).
    Mutation: zero router_jitter_noise like the other jitters (delete the _NOT_NOISE entry) -> fails."""
    model = _build("phimoe", dict(_MOE, router_jitter_noise=0.5))
    eval_before = _eval_logits(model)
    report = disable_dropout_in_model(model)
    assert model.config.router_jitter_noise == 0.5
    assert all(layer.mlp.router.router_jitter_noise == 0.5 for layer in model.model.layers)
    assert torch.equal(_eval_logits(model), eval_before)
    assert any("sparsemixer" in kept for kept in report.kept)
    assert "still random in train mode" in report.describe()
    assert train_mode_nondeterminism(model, _ids()) > 1e-4


def test_measurement_changes_nothing_else():
    """``train_mode_nondeterminism`` puts back every submodule's mode and every random generator, and is
    reproducible. Mutations: drop the fork_rng / numpy / random restore, or restore only the top module's mode
    -> fails."""
    model = _build("llama", dict(_DECODER, attention_dropout=0.3))
    model.model.layers[1].train()  # a mixed state: the top in eval mode, one layer in train mode
    # a forward that also draws from numpy's and Python's generators (as Phi-4-multimodal's audio encoder does)
    model.model.layers[0].register_forward_pre_hook(lambda *_: (np.random.rand(), random.random()) and None)
    modes = [m.training for m in model.modules()]
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    states = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    first = train_mode_nondeterminism(model, _ids())
    assert first > 1e-4
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), states[0])
    assert np.array_equal(np.random.get_state()[1], states[1]) and random.getstate() == states[2]
    assert torch.is_grad_enabled()
    assert train_mode_nondeterminism(model, _ids()) == first  # seeded: the same forwards each time


def test_export_keeps_the_users_dropout_values(tmp_path):
    """The export's config.json has the user's values; training keeps running without dropout after it.
    Mutation: drop ``with user_dropout_config(...)`` from PolicyModule.export_hf -> fails (it writes 0.0)."""
    from lightalign import SFTModule

    kwargs = dict(CASES["falcon"][1], hidden_dropout=0.3, attention_dropout=0.2)
    module = SFTModule(model=_build("falcon", kwargs), disable_dropout=True, recompute_mlp_activation=False)
    model = module.model
    assert (model.config.hidden_dropout, model.config.attention_dropout) == (0.0, 0.0)
    assert "config.hidden_dropout x1" in module.dropout_report.describe()
    disable_dropout_in_model(model)  # a second call (e.g. a re-prepared model) keeps the first call's values

    written = json.loads((module.export_hf(tmp_path / "hf") / "config.json").read_text())
    assert (written["hidden_dropout"], written["attention_dropout"]) == (0.3, 0.2)
    assert (model.config.hidden_dropout, model.config.attention_dropout) == (0.0, 0.0)  # still off for training
    assert train_mode_nondeterminism(model, _ids()) == 0.0

    twin = copy.deepcopy(model)  # the reference copy / the merged-LoRA copy carry the record to their own config
    with user_dropout_config(twin):
        assert twin.config.hidden_dropout == 0.3 and model.config.hidden_dropout == 0.0
    assert twin.config.hidden_dropout == 0.0

    kept = SFTModule(model=_build("falcon", kwargs), disable_dropout=False, recompute_mlp_activation=False)
    assert kept.dropout_report is None and kept.model.config.hidden_dropout == 0.3  # disable_dropout: false
    assert train_mode_nondeterminism(kept.model, _ids()) > 1e-4  # ... leaves the model as it is
    written = json.loads((kept.export_hf(tmp_path / "kept") / "config.json").read_text())
    assert (written["hidden_dropout"], written["attention_dropout"]) == (0.3, 0.2)


def test_fit_start_line_says_what_was_zeroed():
    """Mutation: drop the dropout note from PolicyModule.check_model_layout -> fails."""
    from lightalign import DPOModule

    module = DPOModule(model=_build("llama", dict(_DECODER, attention_dropout=0.3)), reference_free=True)
    module.check_model_layout()  # fit start, without a trainer
    said = "dropout off (attention_dropout x2, config.attention_dropout x1; the export keeps the config's values)"
    assert any(note.startswith(said) for note in module.adaptations.notes), module.adaptations.notes


def test_reward_model_export_keeps_the_users_dropout_values(tmp_path):
    """RewardModule (disable_dropout on by default) writes its own export. Mutation: drop ``with
    user_dropout_config(...)`` from RewardModule.export_hf -> fails."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from lightalign import RewardModule

    config = AutoConfig.for_model("llama", **dict(_DECODER, attention_dropout=0.1), num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    module = RewardModule(model=AutoModelForSequenceClassification.from_config(config), recompute_mlp_activation=False)
    assert module.model.config.attention_dropout == 0.0
    written = json.loads((module.export_hf(tmp_path / "rm") / "config.json").read_text())
    assert written["attention_dropout"] == 0.1 and module.model.config.attention_dropout == 0.0


@pytest.mark.slow
def test_the_console_warns_that_phimoe_samples_its_experts_with_the_measured_size(repo, tmp_path):
    """Issue 48: a new user's PhiMoE run said only in the fit-start info line that two train-mode forwards differ
    (2e-3 to 2e-2 there); it is a warning now, naming the model, the cause and the measured size (a number > 0).
    Mutation: drop the rank_zero_warn from PolicyModule.check_train_determinism -> fails."""
    import re
    import shutil

    from transformers import AutoConfig

    from helpers import console_script

    folder = tmp_path / "phimoe"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(repo / "assets" / "models" / "tiny" / name, folder / name)
    config = AutoConfig.for_model("phimoe", **dict(_MOE, max_position_embeddings=256, router_jitter_noise=0.5))
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    config.save_pretrained(folder)
    out = console_script.expect(repo, "fit", "--config", "configs/quickstart.yaml", "--model.model_name_or_path",
                                str(folder), "--model.disable_dropout", "true", "--trainer.max_steps", "1",
                                "--trainer.limit_val_batches", "0", "--trainer.logger.init_args.save_dir",
                                str(tmp_path / "runs"), "--export.enabled", "false", "--plot.enabled", "false")
    warned = [line for line in out.splitlines() if line.startswith(
        "UserWarning: disable_dropout is on, but PhimoeForCausalLM (model_type 'phimoe') stays random in train mode: "
        "PhiMoE samples its experts in train mode (sparsemixer")]
    assert len(warned) == 1, out[-4000:]
    size = re.search(r"Two train-mode forwards of the same tokens differ by up to (\S+) in the logits", warned[0])
    assert size is not None and float(size.group(1)) > 0, warned[0]
