"""TPO: the triple data (formats, row-by-row refusals), the two batch layouts giving one loss, TPO without a
reference model, its knob checks, and configs/tpo_tiny.yaml through the console script."""

from __future__ import annotations

import csv
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import console_script
from lightalign import PreferenceDataModule, TPOModule, TriplePreferenceDataModule
from lightalign.datamodules.formats import DataFormatError
from lightalign.modules.adaptations.attention import register_varlen_sdpa

TRIPLES = [
    {"prompt": "12+7=", "chosen": "20", "rejected": "5", "reference": "19"},
    {"prompt": "45-3=", "chosen": "43", "rejected": "38", "reference": "42"},
    {"prompt": "8+80=", "chosen": "87", "rejected": "-72", "reference": "88"},
]


def _rows(path, tiny_dir, **kw):
    dm = TriplePreferenceDataModule(str(path), tokenizer=str(tiny_dir), **kw)
    dm.setup("fit")
    return [dm.train_dataset[i] for i in range(len(dm.train_dataset))]


# ------------------------------------------------------------------------------------------------ data
def test_explicit_implicit_and_conversational_triples_tokenize_alike(tiny_dir, write_jsonl, tokenizer):
    """The implicit prompt (the shared start of chosen and rejected) is cut off the reference too, giving the
    explicit rows' tokens; each completion ends with EOS; conversational rows keep their prompt once."""
    explicit = _rows(write_jsonl(TRIPLES), tiny_dir)
    implicit = _rows(write_jsonl([{k: r["prompt"] + r[k] for k in ("chosen", "rejected", "reference")}
                                  for r in TRIPLES], "implicit.jsonl"), tiny_dir)
    for a, b in zip(explicit, implicit):
        for key in ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids", "reference_input_ids"):
            assert a[key] == b[key], key
    assert tokenizer.decode(explicit[0]["reference_input_ids"]) == "19" + tokenizer.eos_token
    chat = [{"prompt": [{"role": "user", "content": r["prompt"]}],
             **{k: [{"role": "assistant", "content": r[k]}] for k in ("chosen", "rejected", "reference")}}
            for r in TRIPLES]
    row = _rows(write_jsonl(chat, "chat.jsonl"), tiny_dir)[0]
    assert "19" in tokenizer.decode(row["reference_input_ids"])
    assert "19" not in tokenizer.decode(row["prompt_input_ids"])


@pytest.mark.parametrize("bad, match", [
    ({"reference": ""}, r"row 1, column 'reference': the text is empty"),
    ({"reference": None}, r"row 1, column 'reference': missing or null"),
])
def test_a_bad_reference_is_refused_naming_its_row_and_column(tiny_dir, write_jsonl, bad, match):
    """Mutation: drop the reference loop of ``TriplePreferenceDataModule.validate`` -> the empty and mixed rows
    tokenize (no error before training)."""
    rows = [dict(r) for r in TRIPLES]
    rows[1].update(bad)
    with pytest.raises(DataFormatError, match=match):
        _rows(write_jsonl(rows), tiny_dir)


def test_a_missing_reference_column_or_prompt_prefix_or_another_kind_is_refused(tiny_dir, write_jsonl):
    chat = [dict(r, reference=[{"role": "assistant", "content": r["reference"]}]) for r in TRIPLES]
    with pytest.raises(DataFormatError, match=r"row 0, column 'reference': a conversation among strings"):
        _rows(write_jsonl(chat), tiny_dir)
    pairs = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in TRIPLES]
    with pytest.raises(DataFormatError, match=r"lacks \['reference'\]"):
        _rows(write_jsonl(pairs), tiny_dir)
    implicit = [{k: r["prompt"] + r[k] for k in ("chosen", "rejected", "reference")} for r in TRIPLES]
    implicit[2]["reference"] = "88"  # does not start with the implicit prompt "8+80="
    with pytest.raises(DataFormatError, match=r"row 2, column 'reference': does not continue the implicit prompt"):
        _rows(write_jsonl(implicit), tiny_dir)


# ------------------------------------------------------------------------------------------------ layouts
def _model(tiny_dir):
    register_varlen_sdpa()
    config = AutoConfig.from_pretrained(tiny_dir)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


class CountingForward(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.inner, self.calls = model, 0
        self.config = model.config

    def forward(self, **kwargs):
        self.calls += 1
        return self.inner(**kwargs)


@pytest.mark.parametrize("tpo_alpha", [1.0, 0.0])
def test_shared_prompt_and_padded_layouts_give_one_loss_in_one_forward(tiny_dir, data_dir, tpo_alpha):
    """The shared-prompt triple segments (prompt once, three branches) and the padded rows: the same loss and
    gradient (float32 sums in another order: 1e-5 relative), each from one policy forward and no other (no
    reference model: TPO is reference-free). Without tpo_alpha the batch holds no reference tokens. Mutations:
    number the reference branch's sequences like the rejected ones (``k * n + i`` -> ``n + i``) in
    ``SharedPromptTripleCollator`` -> fails; a second forward per step -> fails."""
    model = _model(str(tiny_dir))
    results = []
    for sharing in (True, False):
        module = TPOModule(model=model, tpo_alpha=tpo_alpha, loss_type="tpo-l")
        assert module.ref_model is None
        dm = TriplePreferenceDataModule(str(data_dir / "arithmetic_tpo.jsonl"), tokenizer=str(tiny_dir),
                                        batch_size=4, prompt_sharing=sharing, shuffle=False,
                                        include_reference=tpo_alpha != 0)
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))
        assert ("reference_lengths" in batch) == (tpo_alpha != 0)
        counting = module.model = CountingForward(model)
        model.zero_grad()
        loss = module._step(batch, module.train_stats)
        loss.backward()
        assert counting.calls == 1
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (a, grads_a), (b, grads_b) = results
    assert torch.allclose(a, b, rtol=1e-5, atol=0)
    for ga, gb in zip(grads_a, grads_b):
        assert torch.allclose(ga, gb, rtol=1e-4, atol=1e-6)


def test_setup_sets_the_reference_rows_from_tpo_alpha_and_refuses_pair_data(tiny_dir, data_dir):
    dm = TriplePreferenceDataModule(str(data_dir / "arithmetic_tpo.jsonl"), tokenizer=str(tiny_dir))
    module = TPOModule(str(tiny_dir), from_config=True, tpo_alpha=0.0)
    module.use_datamodule(dm)
    assert dm.include_reference is False
    pairs = PreferenceDataModule(str(data_dir / "arithmetic_preference.jsonl"), tokenizer=str(tiny_dir))
    with pytest.raises(ValueError, match="use TriplePreferenceDataModule, not PreferenceDataModule"):
        module.use_datamodule(pairs)
    # an include_reference the user set that disagrees with tpo_alpha is refused, not overridden (mutation: assign
    # without the check -> no error)
    for alpha, given in ((1.0, False), (0.0, True)):
        dm = TriplePreferenceDataModule(str(data_dir / "arithmetic_tpo.jsonl"), tokenizer=str(tiny_dir),
                                        include_reference=given)
        with pytest.raises(ValueError, match=f"include_reference is {given}, but TPOModule's tpo_alpha {alpha}"):
            TPOModule(str(tiny_dir), from_config=True, tpo_alpha=alpha).use_datamodule(dm)


# ------------------------------------------------------------------------------------------------ knobs
def test_knobs_are_trls_and_checked_at_construction(tiny_dir):
    module = TPOModule(str(tiny_dir), from_config=True)
    loss = module.knobs.loss
    assert (loss.loss_type, loss.beta, loss.label_smoothing, loss.tpo_alpha, loss.tpo_l_gamma) == \
        ("sigmoid", 0.01, 0.0, 1.0, 0.5)
    with pytest.raises(ValueError, match=r"Unknown TPO loss_type 'simpo'; valid names are: 'sigmoid', 'hinge', "
                                         r"'ipo', 'tpo-l'"):
        TPOModule(str(tiny_dir), from_config=True, loss_type="simpo")
    for knob, value in (("beta", 0.0), ("tpo_alpha", -1.0), ("label_smoothing", 0.5)):
        with pytest.raises(ValueError, match=knob):
            TPOModule(str(tiny_dir), from_config=True, **{knob: value})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TPOModule(str(tiny_dir), from_config=True, loss_type="hinge", label_smoothing=0.1)
    assert any("ignored by TPO loss_type 'hinge'" in str(w.message) for w in caught)


# ------------------------------------------------------------------------------------------------ console
@pytest.mark.slow
def test_tpo_tiny_config_through_the_console_script(repo, tmp_path):
    proc = console_script.run(repo, "fit", "--config", "configs/tpo_tiny.yaml", "--trainer.max_steps", "2",
                              "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
                              "--data.batch_size", "4", "--checkpoint.every_n_train_steps", "2",
                              "--trainer.logger.init_args.save_dir", str(tmp_path), timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run = tmp_path / "tpo_tiny" / "version_0"
    assert (run / "hf_model" / "config.json").is_file()
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for stage in ("train", "val"):
        for key in ("loss", "entropy", "num_tokens", "logits/chosen", "logits/rejected", "mean_token_accuracy",
                    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                    "logps/rejected"):
            assert any(r.get(f"{stage}/{key}") not in (None, "") for r in rows), f"{stage}/{key}"
    tokens = [float(r["train/num_tokens"]) for r in rows if r.get("train/num_tokens")]
    assert len(tokens) == 2 and all(b > a > 0 for a, b in zip(tokens, tokens[1:]))  # a running count
