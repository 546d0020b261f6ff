"""The shared-prompt pair layout: the prompt computed once, equal to the classic padded chosen/rejected rows."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from helpers.tuning import set_tuned
from lightalign import DPOModule, PreferenceDataModule
from lightalign.datamodules.shared_prefix import CHOSEN, PAD, PROMPT, REJECTED, SharedPromptCollator, pack_rows
from lightalign.datamodules.preference import PreferenceCollator
from lightalign.modules.adaptations.attention import register_varlen_sdpa
from lightalign.modules.dpo import completion_token_logps

ROWS = [  # hand-made token ids: (prompt, chosen, rejected) of different lengths
    {"prompt_input_ids": [5, 6, 7], "chosen_input_ids": [8, 9], "rejected_input_ids": [10, 11, 12]},
    {"prompt_input_ids": [13], "chosen_input_ids": [14, 15, 16, 17], "rejected_input_ids": [18]},
    {"prompt_input_ids": [19, 20, 21, 22, 23], "chosen_input_ids": [24], "rejected_input_ids": [25, 26]},
]


def _model(tiny_dir, attn="sdpa"):
    register_varlen_sdpa()
    config = AutoConfig.from_pretrained(tiny_dir)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_layout_positions_roles_and_mask():
    batch = SharedPromptCollator(pad_token_id=0, pack_length=1)(ROWS[:1])
    # each branch's last token (9, 12) is only a target: not an input position
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 10, 11]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 3, 4]]  # rejected restarts after the prompt
    assert batch["branch"].tolist() == [[PROMPT] * 3 + [CHOSEN] * 1 + [REJECTED] * 2]
    mask = batch["attention_mask"][0, 0]
    chosen, rejected = [3], [4, 5]
    assert not mask[rejected][:, chosen].any()  # rejected never sees chosen
    assert mask[rejected][:, :3].all() and mask[chosen][:, :3].all()  # both see the whole prompt
    assert not mask.triu(1).any()  # causal
    # logits where a completion token is predicted: last prompt token (both first tokens), then inside each one
    assert batch["logits_mask"][0].nonzero().flatten().tolist() == [2, 3, 4, 5]
    assert batch["targets"].tolist() == [8, 9, 10, 11, 12]
    kept = [2, 3, 4, 5]
    assert [kept[i] for i in batch["target_logit_index"].tolist()] == [2, 3, 2, 4, 5]
    assert batch["target_sequence"].tolist() == [0, 0, 1, 1, 1]
    assert batch["target_offset"].tolist() == [0, 1, 0, 1, 2]


def test_packing_keeps_segments_apart_and_pads_only_row_tails():
    batch = SharedPromptCollator(pad_token_id=0, pack_length=12)(ROWS)
    lengths = [6, 4, 6]  # prompt + each branch but its last token
    # ceil(16 / 12) = 2 balanced rows: longest first, each into the shortest row
    assert pack_rows(lengths, 12) == [[0, 1], [2]]
    assert batch["input_ids"].shape == (2, 10)
    assert int((batch["branch"] == PAD).sum()) == 2 * 10 - sum(lengths)
    mask = batch["attention_mask"][0, 0]
    first, second = slice(0, 6), slice(6, 10)  # pair 0 then pair 1 in row 0
    assert not mask[second, first].any()
    assert batch["chosen_lengths"].tolist() == [2, 4, 1] and batch["rejected_lengths"].tolist() == [3, 1, 2]
    # a pair longer than the capacity gets a row of its own
    assert SharedPromptCollator(0, pack_length=4)(ROWS)["input_ids"].shape[0] == 3


def test_balanced_rows_bound_the_padding():
    # first-fit into rows of 100 would give [90, 15] -> 2 rows of width 90, 75 padding positions
    lengths = [50, 40, 15]
    bins = pack_rows(lengths, 100)
    widths = [sum(lengths[i] for i in b) for b in bins]
    assert sorted(widths) == [50, 55] and sorted(i for b in bins for i in b) == [0, 1, 2]
    assert pack_rows(lengths, 1000) == [[0, 1, 2]]
    assert len(pack_rows([7] * 10, 1)) == 10  # at most one row per segment
    # every row holds at most sum / rows + the longest length
    import random

    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 20))]
        bins = pack_rows(lengths, 256)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert max(sum(lengths[i] for i in b) for b in bins) <= sum(lengths) / len(bins) + max(lengths)


def test_pack_length_none_puts_the_whole_batch_in_one_row_without_padding():
    lengths = [6, 4, 6]
    batch = SharedPromptCollator(pad_token_id=0, pack_length=None)(ROWS)
    assert batch["input_ids"].shape == (1, sum(lengths))
    assert not (batch["branch"] == PAD).any()
    mask = batch["attention_mask"][0, 0]
    for i, (start, end) in enumerate([(0, 6), (6, 12), (12, 16)]):  # pairs 0, 2, 1 (longest first): apart
        outside = torch.ones(16, dtype=torch.bool)
        outside[start:end] = False
        assert not mask[start:end][:, outside].any(), i
    with pytest.raises(ValueError, match="pack_length must be >= 1 or None"):
        SharedPromptCollator(0, pack_length=0)


def test_long_rows_with_eager_attention_warn_at_fit_start(tiny_dir, data_dir, quiet_trainer):
    dm = PreferenceDataModule(str(data_dir / "arithmetic_preference.jsonl"), tokenizer=str(tiny_dir), batch_size=2)
    module = DPOModule(model=_model(tiny_dir, "eager"))
    with pytest.warns(UserWarning, match="pack_length"):
        quiet_trainer(max_steps=1, limit_val_batches=0).fit(module, dm)
    bounded = PreferenceDataModule(str(data_dir / "arithmetic_preference.jsonl"), tokenizer=str(tiny_dir),
                                   batch_size=2, pack_length=512)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(max_steps=1, limit_val_batches=0).fit(DPOModule(model=_model(tiny_dir, "eager")), bounded)
    assert not [w for w in caught if "pack_length" in str(w.message)]


@pytest.mark.parametrize("attn", ["sdpa", "sdpa_varlen", "eager"])
@pytest.mark.parametrize("pack_length", [1, 512, None])
def test_shared_logps_equal_classic(tiny_dir, data_dir, attn, pack_length, monkeypatch):
    set_tuned(monkeypatch, "min_saved_scores_per_call", 0)  # sdpa_varlen: split even these short rows
    dm = PreferenceDataModule(str(data_dir / "chat_preference.jsonl"), tokenizer=str(tiny_dir))
    dm.setup("fit")
    rows = [dm.train_dataset[i] for i in range(6)]
    model = _model(tiny_dir, attn)
    classic, classic_mask = completion_token_logps(model, PreferenceCollator(0)(rows))
    shared, shared_mask = completion_token_logps(model, SharedPromptCollator(0, pack_length)(rows))
    assert shared_mask.sum(-1).tolist() == classic_mask.sum(-1).tolist()
    torch.testing.assert_close(shared.sum(-1), classic.sum(-1), atol=1e-5, rtol=0)
    # the same per-token values, in completion order
    torch.testing.assert_close(shared[shared_mask], classic[classic_mask], atol=1e-5, rtol=0)
    tokens_classic = int(PreferenceCollator(0)(rows)["attention_mask"].sum())
    tokens_shared = int((SharedPromptCollator(0, pack_length)(rows)["branch"] >= 0).sum())
    prompt_tokens = sum(len(r["prompt_input_ids"]) for r in rows)
    # each prompt computed once instead of twice, and no branch's last token (only a target) is an input
    assert tokens_classic - tokens_shared == prompt_tokens + 2 * len(rows)


@pytest.mark.parametrize("ld_alpha", [None, 0.5])
def test_dpo_gradients_equal_across_layouts(tiny_dir, data_dir, ld_alpha):
    dm = PreferenceDataModule(str(data_dir / "arithmetic_preference.jsonl"), tokenizer=str(tiny_dir))
    dm.setup("fit")
    rows = [dm.train_dataset[i] for i in range(4)]
    grads = []
    for collator in (PreferenceCollator(0), SharedPromptCollator(0, 512)):
        module = DPOModule(model=_model(tiny_dir), ld_alpha=ld_alpha, loss_type=["sigmoid", "ipo"])
        module.ref_model = copy.deepcopy(module.model).eval()
        with torch.no_grad():  # make the policy differ from the reference
            for p in module.model.parameters():
                p.add_(torch.randn_like(p), alpha=1e-2) if p.dim() > 1 else None
        torch.manual_seed(1)
        module.model.zero_grad()
        module._step(collator(rows), module.train_stats).backward()
        grads.append({n: p.grad.clone() for n, p in module.model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_attention_without_4d_masks_is_refused(tiny_dir):
    model = _model(tiny_dir)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="prompt_sharing=False"):
        completion_token_logps(model, SharedPromptCollator(0)(ROWS))
