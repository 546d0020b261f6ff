"""The DPO loss knobs of TRL 1.16 added to dpo_loss: f_divergence_type / f_alpha_divergence_coef (f-DPO) and
use_weighting (WPO), each against hand computations with plain ``math``."""

from __future__ import annotations

import math

import pytest
import torch

from lightalign.modules.dpo import dpo_loss, f_divergence_scores, validate_loss_config, wpo_weights
from lightalign.modules.training.logprobs import log_sum_squared_probs

PC, PR = [-10.0, -12.5, -8.0], [-11.0, -11.0, -11.0]
RC, RR = [-10.5, -12.0, -8.2], [-11.4, -11.3, -9.0]
LC, LR = [4, 5, 2], [3, 6, 2]
BETA = 0.5


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def logsig(x):
    return -math.log1p(math.exp(-x))


def sig(x):
    return 1 / (1 + math.exp(-x))


# f'(u) with u = exp(log-ratio), written from the f-DPO definitions
SCORE = {
    "reverse_kl": lambda x: x,
    "forward_kl": lambda x: 1 - 1 / math.exp(x),
    "js_divergence": lambda x: math.log(2 * math.exp(x) / (1 + math.exp(x))),
    "alpha_divergence": lambda x: (math.exp(x) ** (0.3 - 1) - 1) / (0.3 - 1),  # coef 0.3
}


def scores(i, kind):
    return SCORE[kind](PC[i] - RC[i]), SCORE[kind](PR[i] - RR[i])


def run(loss_type, kind, **kw):
    return dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=BETA, loss_type=loss_type, f_divergence_type=kind,
                    f_alpha_divergence_coef=0.3, chosen_lengths=torch.tensor(LC), rejected_lengths=torch.tensor(LR),
                    **kw)[0].tolist()


@pytest.mark.parametrize("kind", list(SCORE))
def test_f_divergence_scores_by_hand(kind):
    x = [-1.5, -0.2, 0.0, 0.7, 2.0]
    assert f_divergence_scores(t(x), kind, 0.3).tolist() == pytest.approx([SCORE[kind](v) for v in x], abs=1e-9)


@pytest.mark.parametrize("kind", ["forward_kl", "js_divergence", "alpha_divergence"])
def test_f_divergence_enters_every_score_loss(kind):
    def each(fn):
        return [fn(*scores(i, kind), i) for i in range(3)]

    z = lambda c, r: BETA * (c - r)  # noqa: E731
    assert run("sigmoid", kind) == pytest.approx(each(lambda c, r, i: -logsig(z(c, r))), abs=1e-9)
    assert run("hinge", kind) == pytest.approx(each(lambda c, r, i: max(0.0, 1 - z(c, r))), abs=1e-9)
    assert run("ipo", kind) == pytest.approx(each(lambda c, r, i: (c / LC[i] - r / LR[i] - 1 / (2 * BETA)) ** 2),
                                             abs=1e-9)
    assert run("sigmoid_norm", kind) == pytest.approx(
        each(lambda c, r, i: -logsig(BETA * (c / LC[i] - r / LR[i]))), abs=1e-9)
    eps = 0.1
    assert run("robust", kind, label_smoothing=eps) == pytest.approx(
        each(lambda c, r, i: (-(1 - eps) * logsig(z(c, r)) + eps * logsig(-z(c, r))) / (1 - 2 * eps)), abs=1e-9)
    assert run("discopop", kind) == pytest.approx(each(
        lambda c, r, i: (1 - sig(z(c, r) / 0.05)) * -logsig(z(c, r)) + sig(z(c, r) / 0.05) * math.exp(-z(c, r))),
        abs=1e-9)
    # the sft term reads no log-ratio, and the rewards stay beta * log-ratio
    assert run("sft", kind) == pytest.approx(run("sft", "reverse_kl"), abs=1e-12)
    _, chosen, _ = dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=BETA, f_divergence_type=kind)
    assert chosen.tolist() == pytest.approx([BETA * (a - b) for a, b in zip(PC, RC)], abs=1e-12)


def test_alpha_divergence_at_one_is_reverse_kl_and_large_ratios_stay_finite():
    assert run("sigmoid", "alpha_divergence", ) != run("sigmoid", "reverse_kl")
    at_one = dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=BETA, f_divergence_type="alpha_divergence",
                      f_alpha_divergence_coef=1.0)[0]
    assert at_one.tolist() == pytest.approx(run("sigmoid", "reverse_kl"), abs=1e-12)
    huge = f_divergence_scores(torch.tensor([-500.0]), "alpha_divergence", 0.5)  # exponent 250 clamped at 80
    assert torch.isfinite(huge).all() and huge.item() == pytest.approx(math.expm1(80.0) / -0.5, rel=1e-5)


def test_f_divergence_validation():
    for loss_type in ("bco_pair", "nca_pair", "sppo_hard", "aot", "aot_pair", "apo_zero", "apo_down"):
        with pytest.raises(ValueError, match=f"f_divergence_type='forward_kl' does not apply.*{loss_type}"):
            validate_loss_config(loss_type, None, 0.1, 0.0, "forward_kl")
    assert validate_loss_config("bco_pair", None, 0.1, 0.0, "reverse_kl") == ["bco_pair"]
    with pytest.raises(ValueError, match="Unknown f_divergence_type 'kl'.*'forward_kl'"):
        validate_loss_config("sigmoid", None, 0.1, 0.0, "kl")
    with pytest.raises(ValueError, match="f_alpha_divergence_coef"):
        validate_loss_config("sigmoid", None, 0.1, 0.0, "alpha_divergence", float("nan"))


# ----------------------------------------------------------------------------------------------------- WPO
def test_log_sum_squared_probs_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [1.0, 1.0]]])  # p = (1/4, 3/4) and (1/2, 1/2)
    expected = [math.log(1 / 16 + 9 / 16), math.log(1 / 4 + 1 / 4)]
    assert log_sum_squared_probs(logits, chunk_rows=1)[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_wpo_weights_by_hand():
    # rows: chosen 0, chosen 1, rejected 0, rejected 1; completion tokens where mask is 1
    logps = t([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0], [-3.0, -1.0, -2.0], [-0.2, -0.4, 0.0]])
    squares = t([[-0.7, -0.9, 5.0], [-0.1, 9.0, 9.0], [-1.0, -1.0, -1.0], [-0.3, -0.3, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    chosen, rejected = wpo_weights(logps, squares, mask)
    assert chosen.tolist() == pytest.approx([math.exp(((-1 + 0.7) + (-2 + 0.9)) / 2), math.exp(-0.5 + 0.1)])
    assert rejected.tolist() == pytest.approx([math.exp(((-3 + 1) + (-1 + 1) + (-2 + 1)) / 3),
                                               math.exp(((-0.2 + 0.3) + (-0.4 + 0.3)) / 2)])
    assert not chosen.requires_grad


def test_pair_weights_scale_every_term_and_sft_is_weighted_batch_nll():
    w = t([0.5, 2.0, 0.1])
    plain = dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=BETA)[0]
    weighted = dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=BETA, pair_weights=w)[0]
    assert weighted.tolist() == pytest.approx((plain * w).tolist(), abs=1e-12)
    sft = dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=BETA, loss_type="sft", chosen_lengths=torch.tensor(LC),
                   pair_weights=w)[0]
    batch_nll = -sum(PC) / sum(LC)
    assert sft.tolist() == pytest.approx([batch_nll * x for x in (0.5, 2.0, 0.1)], abs=1e-12)
    # the weights carry no gradient
    pc = t(PC).requires_grad_()
    grad_w = t([0.5, 2.0, 0.1]).requires_grad_()
    dpo_loss(pc, t(PR), t(RC), t(RR), beta=BETA, pair_weights=grad_w)[0].sum().backward()
    assert grad_w.grad is None
    with pytest.raises(ValueError, match="use_weighting=True.*aot"):
        dpo_loss(t(PC), t(PR), t(RC), t(RR), loss_type="aot", pair_weights=w)


# ----------------------------------------------------------------------------------------------- DPOModule
ROWS = [  # hand-made token ids: (prompt, chosen, rejected) of different lengths
    {"prompt_input_ids": [5, 6, 7], "chosen_input_ids": [8, 9], "rejected_input_ids": [10, 11, 12]},
    {"prompt_input_ids": [13], "chosen_input_ids": [14, 15, 16, 17], "rejected_input_ids": [18]},
]


def _batches():
    from lightalign.datamodules.preference import PreferenceCollator
    from lightalign.datamodules.shared_prefix import SharedPromptCollator

    return {"classic": PreferenceCollator(pad_token_id=0)(ROWS),
            "shared": SharedPromptCollator(pad_token_id=0, pack_length=64)(ROWS)}


def _brute_force_weights(model, batch):
    """WPO weights from the classic batch's full logits: softmax, square, sum - nothing shared with the code."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].double()
    probs = logits.softmax(-1)
    picked = probs.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1).log()
    aligned = picked - (probs ** 2).sum(-1).log()
    mask = batch["completion_mask"][:, 1:].double()
    weights = ((aligned * mask).sum(-1) / mask.sum(-1)).exp()
    return weights[:2] * weights[2:]


@pytest.mark.parametrize("layout", ["classic", "shared"])
def test_module_wpo_weights_scale_the_pair_losses(tiny_model, layout):
    from lightalign import DPOModule
    from lightalign.modules.adaptations.attention import use_varlen_sdpa

    use_varlen_sdpa(tiny_model)
    batches = _batches()
    expected_w = _brute_force_weights(tiny_model, batches["classic"])
    plain = DPOModule(model=tiny_model, reference_free=True)
    weighted = DPOModule(model=tiny_model, reference_free=True, use_weighting=True)
    with torch.no_grad():
        pc, pr, _, none = plain._pair_logps_and_chosen_sums(tiny_model, batches[layout])
        _, _, _, w = weighted._pair_logps_and_chosen_sums(tiny_model, batches[layout], weighting=True)
    assert none is None
    torch.testing.assert_close(w.double(), expected_w, atol=1e-5, rtol=1e-5)
    per_pair = dpo_loss(pc, pr, None, None, reference_free=True)[0]
    loss = weighted._step(batches[layout], weighted.train_stats)
    assert loss.item() == pytest.approx((per_pair * w).mean().item(), abs=1e-6)
    assert not torch.allclose(w, torch.ones_like(w))  # the weights do change the loss


def test_module_f_divergence_changes_the_loss_as_the_formula_says(monkeypatch, tiny_model):
    import lightalign.modules.dpo as dpo_module
    from lightalign import DPOModule

    token_logps = torch.tensor([[-1.0, -1.0], [-3.0, 0.0], [-3.0, 0.0], [-0.5, -0.5]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1]])
    monkeypatch.setattr(dpo_module, "completion_token_logps", lambda model, batch: (token_logps, mask))
    batch = {"input_ids": torch.zeros(4, 4, dtype=torch.long), "attention_mask": torch.ones(4, 4, dtype=torch.long),
             "completion_mask": torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0]])}
    module = DPOModule(model=tiny_model, beta=0.5, reference_free=True, f_divergence_type="forward_kl")
    f = lambda x: 1 - math.exp(-x)  # noqa: E731  forward KL's f'(u), u = exp(log-ratio); reference 0
    expected = (-logsig(0.5 * (f(-2.0) - f(-3.0))) - logsig(0.5 * (f(-3.0) - f(-1.0)))) / 2
    assert module._step(batch, module.train_stats).item() == pytest.approx(expected, abs=1e-6)


def test_module_knobs_are_validated_at_construction(tiny_model):
    from lightalign import DPOModule

    cases = [
        (dict(f_divergence_type="forward_kl", loss_type="bco_pair"), "f_divergence_type='forward_kl' does not apply"),
        (dict(f_divergence_type="chi2"), "Unknown f_divergence_type 'chi2'"),
        (dict(use_weighting=True, loss_type="aot"), "use_weighting=True"),
        (dict(loss_type="discopop", discopop_tau=0.0), "discopop_tau must be > 0"),
        (dict(precompute_ref_batch_size=0, precompute_ref_log_probs=True), "precompute_ref_batch_size must be >= 1"),
        (dict(precompute_ref_batch_size=8), "set precompute_ref_log_probs=True"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            DPOModule(model=tiny_model, **kwargs)


def test_each_group_is_checked_once_at_construction_and_a_step_checks_nothing_again(monkeypatch, tiny_model):
    """DPOModule's knobs are checked when its groups are built, once each; a training step neither builds a group
    again nor checks a value inside ``dpo_loss`` (``beta=0``, refused by ``ImplicitRewardKnobs``, is plain
    arithmetic there). Mutation: call ``validate_loss_config`` in ``_step``, or put the beta check into
    ``dpo_loss`` -> this test fails."""
    from lightalign import DPOModule
    from lightalign.knobs import KnobGroup

    built = []
    check = KnobGroup.__post_init__
    monkeypatch.setattr(KnobGroup, "__post_init__", lambda group: (built.append(type(group).__name__), check(group)))
    module = DPOModule(model=tiny_model, reference_free=True, loss_type=["sigmoid", "ipo"], ld_alpha=0.5)
    assert sorted(built) == sorted(g.__name__ for g in DPOModule.knob_groups)
    built.clear()
    module._step(_batches()["classic"], module.train_stats)
    assert built == []
    losses, _, _ = dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=0.0)
    torch.testing.assert_close(losses, t([math.log(2)] * 3))


def test_precompute_ref_batch_size_sets_the_pass_batches(tiny_dir, data_dir, tmp_path, tiny_model):
    import lightning as L

    from lightalign import DPOModule, PreferenceDataModule
    from lightalign.modules.dpo import pair_count

    import json

    from datasets import Dataset

    tiny_model.save_pretrained(tmp_path / "m")
    lines = (data_dir / "arithmetic_preference.jsonl").read_text().splitlines()[:13]
    path = Dataset.from_list([json.loads(line) for line in lines])
    results, sizes = {}, {}
    for batch_size in (None, 5):
        module = DPOModule(str(tmp_path / "m"), precompute_ref_log_probs=True, precompute_ref_batch_size=batch_size,
                           ref_log_probs_cache_dir=str(tmp_path / f"cache{batch_size}"))
        seen = []
        original = module.reference_logps
        module.reference_logps = lambda batch, original=original, seen=seen: (seen.append(pair_count(batch))
                                                                             or original(batch))
        data = PreferenceDataModule(path, tokenizer=str(tiny_dir), batch_size=2, val_batch_size=3)
        L.Trainer(accelerator="cpu", max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0).fit(module, data)
        results[batch_size], sizes[batch_size] = data.reference_logps["train"], seen
    assert max(sizes[None]) == 3 and max(sizes[5]) == 5  # val_batch_size by default, else the knob
    for a, b in zip(results[None], results[5]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------- padding_free
def _pf_batches():
    from lightalign.datamodules.preference import PaddingFreePreferenceCollator, PreferenceCollator

    rows = ROWS + [{"prompt_input_ids": [19, 20, 21, 22, 23], "chosen_input_ids": [24],
                    "rejected_input_ids": [25, 26]}]
    return PreferenceCollator(pad_token_id=0)(rows), PaddingFreePreferenceCollator()(rows)


def _loss_and_grads(module, batch):
    module.model.zero_grad()
    loss = module._step(batch, module.train_stats)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family, knobs", [("tiny", dict()), ("tiny", dict(loss_type=["ipo", "sft"], ld_alpha=0.5)),
                                           ("tiny", dict(use_weighting=True)), ("gpt2", dict())])
def test_padding_free_equals_the_padded_layout(tiny_model, family, knobs):
    """Equal losses and gradients, also on gpt2, whose learned absolute positions see any position id error
    (rotary models are blind to a constant shift)."""
    from lightalign import DPOModule
    from lightalign.modules.dpo import completion_lengths, pair_count, real_token_count

    padded, packed = _pf_batches()
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed
    assert pair_count(packed) == 3 and real_token_count(packed) == int(padded["attention_mask"].sum())
    for a, b in zip(completion_lengths(padded), completion_lengths(packed)):
        assert a.tolist() == b.tolist()
    if family == "gpt2":
        from helpers.conformance_models import build

        tiny_model = build("gpt2").train()
    module = DPOModule(model=tiny_model, **knobs)
    module.configure_model()  # a frozen copy of the policy as reference
    with torch.no_grad():
        for p in module.model.parameters():  # the policy moves away from its reference
            p.add_(0.01 * torch.randn_like(p))
    module.model.train()
    loss_a, grads_a = _loss_and_grads(module, padded)
    loss_b, grads_b = _loss_and_grads(module, packed)
    assert loss_b.item() == pytest.approx(loss_a.item(), abs=1e-5)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-5, rtol=1e-4)


def test_padding_free_is_refused_where_packing_is_and_needs_the_classic_layout(tiny_dir, data_dir):
    from lightalign import DPOModule, PreferenceDataModule
    from lightalign.modules.adaptations import LayoutRefused
    from helpers.conformance_models import build

    with pytest.raises(ValueError, match="padding_free=True packs the classic .* set prompt_sharing: false"):
        PreferenceDataModule(str(data_dir / "arithmetic_preference.jsonl"), tokenizer=str(tiny_dir), padding_free=True)
    data = PreferenceDataModule(str(data_dir / "arithmetic_preference.jsonl"), tokenizer=str(tiny_dir),
                                padding_free=True, prompt_sharing=False)
    data.tokenizer = type("T", (), {"pad_token_id": 0})()
    assert type(data.default_collator()).__name__ == "PaddingFreePreferenceCollator"
    import lightning as L

    module = DPOModule(model=build("lfm2"))  # conv layers: packed sequences mix (measured, every version)
    data = PreferenceDataModule(str(data_dir / "arithmetic_preference.jsonl"), tokenizer=str(tiny_dir),
                                padding_free=True, prompt_sharing=False)
    with pytest.raises(LayoutRefused, match="data.padding_free"):  # at fit start, before any step
        L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False).fit(module, data)
    assert module.reference_forward_calls == 0


def test_padding_free_fit_and_precompute(tiny_dir, data_dir, tmp_path):
    import json

    import lightning as L
    from datasets import Dataset

    from lightalign import DPOModule, PreferenceDataModule

    lines = (data_dir / "arithmetic_preference.jsonl").read_text().splitlines()[:8]
    data = PreferenceDataModule(Dataset.from_list([json.loads(x) for x in lines]), tokenizer=str(tiny_dir),
                                batch_size=2, padding_free=True, prompt_sharing=False)
    module = DPOModule(str(tiny_dir), from_config=True, precompute_ref_log_probs=True,
                       ref_log_probs_cache_dir=str(tmp_path / "cache"))
    L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0).fit(module, data)
    assert module.adaptations.layout == "padding_free"
    assert len(data.reference_logps["train"][0]) == 8
