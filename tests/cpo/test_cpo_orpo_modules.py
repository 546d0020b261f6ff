"""CPOModule and ORPOModule: no reference model anywhere, one policy forward per batch, the same loss and gradients
in every pair layout (ORPO's NLL over the whole chosen sequence, prompt included, in each), TRL's statistics under
``train/`` and ``val/``, and their knob checks."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM

from lightalign import CPOModule, ORPOModule, PreferenceDataModule
from lightalign.datamodules.preference import PaddingFreePreferenceCollator, PreferenceCollator
from lightalign.datamodules.shared_prefix import SharedPromptCollator
from lightalign.knobs import method_knobs
from lightalign.modules.training.preference_forward import completion_and_prompt_logps

REFERENCE_KNOBS = ("ref_model_name_or_path", "precompute_ref_log_probs", "sync_ref_model", "num_shared_layers",
                   "reference_free")
CPO_STATS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected", "nll_loss")
METHODS = [(CPOModule, {"loss_type": "sigmoid"}, CPO_STATS), (CPOModule, {"loss_type": "simpo"}, CPO_STATS),
           (ORPOModule, {}, (*CPO_STATS, "log_odds_ratio", "log_odds_chosen"))]
IDS = ["cpo-sigmoid", "cpo-simpo", "orpo"]


def _model(tiny_dir):
    config = AutoConfig.from_pretrained(tiny_dir)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _rows(data_dir, n):
    lines = (data_dir / "arithmetic_preference.jsonl").read_text().splitlines()[:n]
    return Dataset.from_list([json.loads(line) for line in lines])


# prompts of different lengths; pack_length 12 spreads the pairs over rows, the longest first (not in pair order)
UNEVEN = [{"prompt": "7=", "chosen": "7", "rejected": "8"},
          {"prompt": "21+82=", "chosen": "103", "rejected": "93"},
          {"prompt": "100+250+3=", "chosen": "353", "rejected": "35"},
          {"prompt": "9-4=", "chosen": "5", "rejected": "6"}]
COLLATORS = [PreferenceCollator(0), SharedPromptCollator(0, 12), PaddingFreePreferenceCollator()]


def _uneven_rows(tiny_dir):
    dm = PreferenceDataModule(Dataset.from_list(UNEVEN), tokenizer=str(tiny_dir), val_split_size=0)
    dm.setup("fit")
    rows = sorted((dm.train_dataset[i] for i in range(4)), key=lambda row: row["index"])
    assert len({len(row["prompt_input_ids"]) for row in rows}) == 4
    return rows


def test_chosen_prompt_logps_in_every_layout(tiny_dir):
    """ORPO's prompt part of the NLL, from each layout's one forward: each chosen sequence's predicted prompt tokens
    (all but the first) and their summed log-probs, the same in the classic, shared-prompt (several rows, pairs
    out of order) and padding-free layouts, and the completion log-probs unchanged beside them. Mutations: the shared
    layout's prompt tokens assigned to the wrong pair (``prompt_pairs`` from the rejected sequence id without the
    modulo, or from the row's segment number) -> fails; a segment's first prompt token counted (``positions > 0``
    dropped) -> fails."""
    rows = _uneven_rows(tiny_dir)
    model = _model(tiny_dir)
    out = []
    for collator in COLLATORS:
        batch = collator(rows)
        if isinstance(collator, SharedPromptCollator):
            assert batch["input_ids"].shape[0] > 1
        with torch.no_grad():
            out.append(completion_and_prompt_logps(model, batch))
    for token_logps, mask, prompt_logps, prompt_lengths in out:
        assert prompt_lengths.tolist() == [len(row["prompt_input_ids"]) - 1 for row in rows]
        torch.testing.assert_close(prompt_logps, out[0][2], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(token_logps.sum(-1), out[0][0].sum(-1), atol=1e-5, rtol=1e-5)
    assert (out[0][2] < 0).all()  # every prompt here has 2 tokens or more


def test_orpo_nll_is_the_chosen_rows_cross_entropy(tiny_dir):
    """``ORPOModule`` at ``beta`` 0 is its NLL alone: in every layout, TRL's cross-entropy of the padded chosen
    rows (every real token after each row's first, prompt included, one token mean over the batch), computed here
    with ``F.cross_entropy``. Mutation: ``ORPOModule.scores_chosen_prompt`` off with zeros passed for the prompt part
    (the completion-only NLL) -> fails."""
    rows = _uneven_rows(tiny_dir)
    module = ORPOModule(model=_model(tiny_dir), beta=0.0)
    classic = COLLATORS[0](rows)
    with torch.no_grad():
        logits = module.model(input_ids=classic["input_ids"], attention_mask=classic["attention_mask"]).logits
        labels = classic["input_ids"].masked_fill(classic["attention_mask"] == 0, -100)[:4, 1:]
        expected = torch.nn.functional.cross_entropy(logits[:4, :-1].flatten(0, 1), labels.flatten())
        for collator in COLLATORS:
            torch.testing.assert_close(module._step(collator(rows), module.train_stats), expected, atol=1e-6,
                                       rtol=1e-5)


@pytest.mark.parametrize("cls, knobs, stats", METHODS, ids=IDS)
def test_layouts_give_the_same_loss_and_gradients(tiny_dir, cls, knobs, stats):
    """The shared-prompt layout (default), the classic padded one and padding-free, on prompts of different
    lengths: one loss, one gradient (float32 sums in another order). Mutations: the shared layout's chosen lengths
    one too many (``completion_lengths``) -> fails; ORPO's shared layout leaving out the prompt's log-probs (its
    ``prompt_logps`` zeros) -> fails."""
    rows = _uneven_rows(tiny_dir)
    losses, grads = [], []
    for collator in COLLATORS:
        module = cls(model=_model(tiny_dir), **knobs)
        loss = module._step(collator(rows), module.train_stats)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in module.model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=1e-5)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for g in grads[0].values())


@pytest.mark.parametrize("cls, knobs, stats", METHODS[1:], ids=IDS[1:])
def test_no_reference_one_forward_per_batch_and_trls_statistics(tiny_dir, data_dir, quiet_trainer, cls, knobs,
                                                                 stats):
    """No reference knob, component or pass: the policy's forward runs once per training batch, and TRL's
    statistics are logged under ``train/`` and ``val/``. Mutations: ``CPOModule`` taking ``ReferenceKnobs`` (its
    knobs then list ``ref_model_name_or_path``) -> fails; a second policy forward in ``_step`` -> fails."""
    assert not set(REFERENCE_KNOBS) & set(method_knobs(cls))
    with pytest.raises(TypeError, match="has no knob 'ref_model_name_or_path'; .*DPOModule"):
        cls(str(tiny_dir), from_config=True, ref_model_name_or_path=str(tiny_dir))
    module = cls(model=_model(tiny_dir), learning_rate=1e-3, **knobs)
    forwards = []
    module.model.register_forward_hook(lambda *args: forwards.append(module.training))
    dm = PreferenceDataModule(_rows(data_dir, 12), tokenizer=str(tiny_dir), batch_size=4, val_split_size=4)
    trainer = quiet_trainer(max_steps=2, limit_val_batches=1, val_check_interval=2, check_val_every_n_epoch=None)
    trainer.fit(module, dm)
    assert forwards.count(True) == 2  # two training batches, one forward each (and no reference pass)
    assert module.ref_model is None and not module.uses_reference_model
    assert not any("ref" in name for name, _ in module.named_children())
    for stage in ("train", "val"):
        missing = [name for name in stats if f"{stage}/{name}" not in trainer.callback_metrics]
        assert not missing, (stage, missing)
    assert trainer.callback_metrics["train/nll_loss"] > 0


def test_knob_checks(tiny_dir):
    """Refusals naming the knob, before any model loads."""
    with pytest.raises(ValueError, match="Unknown CPO loss_type 'kto_pair'; valid names are: 'sigmoid', 'hinge'"):
        CPOModule(str(tiny_dir), from_config=True, loss_type="kto_pair")
    with pytest.raises(ValueError, match="has no NLL term"):
        CPOModule(str(tiny_dir), from_config=True, loss_type="alphapo", cpo_alpha=0.5)
    with pytest.raises(ValueError, match="label_smoothing must lie in"):
        CPOModule(str(tiny_dir), from_config=True, label_smoothing=0.5)
    with pytest.raises(ValueError, match="cpo_alpha must be"):
        CPOModule(str(tiny_dir), from_config=True, cpo_alpha=-1.0)
    with pytest.raises(ValueError, match="beta is one number for CPOModule"):
        CPOModule(str(tiny_dir), from_config=True, beta=[0.1, 0.2])
    with pytest.raises(ValueError, match=r"beta \(ORPO's odds-ratio weight lambda\) must be"):
        ORPOModule(str(tiny_dir), from_config=True, beta=-0.1)
    with pytest.warns(UserWarning, match="label_smoothing=0.1 is ignored by loss_type='hinge'"):
        CPOModule(str(tiny_dir), from_config=True, loss_type="hinge", label_smoothing=0.1)


def test_orpo_adds_nothing_a_checkpoint_holds_to_what_cpo_resumes(tiny_dir):
    """ORPO's exact resume under DDP is CPO's (tests/training/test_resume.py's ``cpo`` case runs their shared base
    ``ReferenceFreePairModule`` through a SIGKILL and a resume): what ORPO defines of its own is its loss
    (``pair_loss``), its statistics' names and the prompt scoring switch, no hook a fit or a checkpoint passes
    through (every other method is CPO's own function) and no parameter or buffer beyond the policy's. An ORPO
    that keeps state of its own (a buffer, a checkpoint hook) fails here: it would need a resume case of its own."""
    own = {name for name, value in vars(ORPOModule).items() if callable(value) and name != "__init__"}
    assert own == {"pair_loss"}, own
    assert ORPOModule.__init__.__code__ is CPOModule.__init__.__code__  # the knob constructor takes_knobs makes

    def owner(cls, name):  # the class whose body defines ``name`` for ``cls``
        return next(k for k in cls.__mro__ if name in vars(k))

    skipped = {"pair_loss", "check_knob_combinations", "__init__"}
    differ = [n for n in dir(ORPOModule) if n not in skipped and callable(getattr(ORPOModule, n))
              and owner(ORPOModule, n) is not owner(CPOModule, n)]
    assert not differ, differ
    orpo, cpo = ORPOModule(str(tiny_dir), from_config=True), CPOModule(str(tiny_dir), from_config=True)
    orpo.configure_model()
    cpo.configure_model()
    assert orpo.state_dict().keys() == cpo.state_dict().keys() == {f"model.{k}" for k in orpo.model.state_dict()}
