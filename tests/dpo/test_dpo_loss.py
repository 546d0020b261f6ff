"""dpo_loss against hand computations (plain ``math`` on Python floats), one per TRL loss type, plus the knobs."""

from __future__ import annotations

import math

import pytest
import torch

from lightalign.modules.dpo import LOSS_TYPES, DPOLossConfig, dpo_loss, length_desensitized_logps, validate_loss_config

PC = [-10.0, -12.5, -8.0]  # policy chosen
PR = [-11.0, -11.0, -11.0]  # policy rejected
RC = [-10.5, -12.0, -8.2]  # reference chosen
RR = [-11.4, -11.3, -9.0]  # reference rejected
LC = [4, 5, 2]  # chosen lengths
LR = [3, 6, 2]  # rejected lengths
BETA = 0.5


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def logsig(x):
    return -math.log1p(math.exp(-x))


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def run(loss_type, **kw):
    kw.setdefault("beta", BETA)
    return dpo_loss(t(PC), t(PR), t(RC), t(RR), loss_type=loss_type,
                    chosen_lengths=torch.tensor(LC), rejected_lengths=torch.tensor(LR), **kw)


def per_example(fn):
    """fn(c, r, z, i) with c, r the chosen/rejected log-ratios and z = c - r, all unscaled."""
    return [fn(PC[i] - RC[i], PR[i] - RR[i], (PC[i] - RC[i]) - (PR[i] - RR[i]), i) for i in range(3)]


def aot_expected(xs, ys, eps=0.0):
    return [-(1 - eps) * logsig(BETA * (a - b)) - eps * logsig(-BETA * (a - b)) for a, b in zip(sorted(xs), sorted(ys))]


TAU = 0.05
EXPECTED = {
    "sigmoid": per_example(lambda c, r, z, i: -logsig(BETA * z)),
    "hinge": per_example(lambda c, r, z, i: max(0.0, 1 - BETA * z)),
    "ipo": per_example(lambda c, r, z, i: (c / LC[i] - r / LR[i] - 1 / (2 * BETA)) ** 2),
    "robust": per_example(lambda c, r, z, i: -logsig(BETA * z)),  # eps = 0
    "bco_pair": per_example(lambda c, r, z, i: -logsig(BETA * c) - logsig(-BETA * r)),
    "sppo_hard": per_example(lambda c, r, z, i: (c - 1 / (2 * BETA)) ** 2 + (r + 1 / (2 * BETA)) ** 2),
    "nca_pair": per_example(lambda c, r, z, i: -logsig(BETA * c) - 0.5 * logsig(-BETA * c) - 0.5 * logsig(-BETA * r)),
    "aot": aot_expected([a - b for a, b in zip(PC, PR)], [a - b for a, b in zip(RC, RR)]),
    "aot_pair": aot_expected([a - b for a, b in zip(PC, RC)], [a - b for a, b in zip(PR, RR)]),
    "apo_zero": per_example(lambda c, r, z, i: (1 - sig(BETA * c)) + sig(BETA * r)),
    "apo_down": per_example(lambda c, r, z, i: sig(BETA * c) + 1 - sig(BETA * z)),
    "discopop": per_example(
        lambda c, r, z, i: (1 - sig(BETA * z / TAU)) * -logsig(BETA * z) + sig(BETA * z / TAU) * math.exp(-BETA * z)
    ),
    # TRL's mean token NLL over the batch's chosen tokens, spread so that the mean over examples equals it
    "sft": [-PC[i] * 3 / sum(LC) for i in range(3)],
    "sigmoid_norm": per_example(lambda c, r, z, i: -logsig(BETA * (c / LC[i] - r / LR[i]))),
}
EXPECTED["aot_unpaired"] = EXPECTED["aot_pair"]  # TRL 1.16's name for the same loss
EXO_EPS = 1e-3
EXPECTED["exo_pair"] = per_example(
    lambda c, r, z, i: sig(BETA * z) * (logsig(BETA * z) - math.log(1 - EXO_EPS))
    + sig(-BETA * z) * (logsig(-BETA * z) - math.log(EXO_EPS))
)


def test_every_loss_type_has_a_hand_value():
    assert set(EXPECTED) == set(LOSS_TYPES)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_type_matches_hand_computation(loss_type):
    kw = {"label_smoothing": EXO_EPS} if loss_type == "exo_pair" else {}
    if loss_type == "discopop":
        kw["discopop_tau"] = TAU
    losses, _, _ = run(loss_type, **kw)
    assert losses.shape == (3,)
    assert losses.tolist() == pytest.approx(EXPECTED[loss_type], abs=1e-6)


def test_sft_mean_is_token_level_nll():
    losses, _, _ = run("sft")
    assert losses.mean().item() == pytest.approx(-sum(PC) / sum(LC), abs=1e-6)


def test_rewards_are_beta_times_logratio_and_detached():
    pc = t(PC).requires_grad_()
    losses, chosen, rejected = dpo_loss(pc, t(PR), t(RC), t(RR), beta=BETA)
    assert chosen.tolist() == pytest.approx([BETA * (a - b) for a, b in zip(PC, RC)], abs=1e-6)
    assert rejected.tolist() == pytest.approx([BETA * (a - b) for a, b in zip(PR, RR)], abs=1e-6)
    assert not chosen.requires_grad and not rejected.requires_grad
    assert losses.requires_grad


def test_weighted_list_gives_each_term_its_inputs():
    losses, _, _ = run(["sigmoid", "ipo"], loss_weights=[0.3, 2.0])
    expected = [0.3 * s + 2.0 * p for s, p in zip(EXPECTED["sigmoid"], EXPECTED["ipo"])]
    assert losses.tolist() == pytest.approx(expected, abs=1e-6)
    unweighted, _, _ = run(["hinge", "sppo_hard"])
    assert unweighted.tolist() == pytest.approx([a + b for a, b in zip(EXPECTED["hinge"], EXPECTED["sppo_hard"])],
                                                abs=1e-6)


def test_reference_free_treats_reference_as_zero():
    losses, chosen, rejected = dpo_loss(t(PC), t(PR), None, None, beta=BETA, reference_free=True)
    assert losses.tolist() == pytest.approx([-logsig(BETA * (a - b)) for a, b in zip(PC, PR)], abs=1e-6)
    assert chosen.tolist() == pytest.approx([BETA * a for a in PC], abs=1e-6)
    assert rejected.tolist() == pytest.approx([BETA * b for b in PR], abs=1e-6)
    ignored, _, _ = dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=BETA, reference_free=True)
    assert torch.equal(ignored, losses)
    with pytest.raises(ValueError, match="reference_free"):
        dpo_loss(t(PC), t(PR), None, None)


def test_label_smoothing_sigmoid_and_robust():
    eps = 0.1
    with_eps = {k: run(k, label_smoothing=eps)[0] for k in ("sigmoid", "robust")}
    sigmoid = per_example(lambda c, r, z, i: -(1 - eps) * logsig(BETA * z) - eps * logsig(-BETA * z))
    robust = per_example(lambda c, r, z, i: (-(1 - eps) * logsig(BETA * z) + eps * logsig(-BETA * z)) / (1 - 2 * eps))
    assert with_eps["sigmoid"].tolist() == pytest.approx(sigmoid, abs=1e-6)
    assert with_eps["robust"].tolist() == pytest.approx(robust, abs=1e-6)
    for k in ("sigmoid", "robust"):
        assert not torch.allclose(with_eps[k], t(EXPECTED[k]))
    assert run("aot", label_smoothing=eps)[0].tolist() == pytest.approx(
        aot_expected([a - b for a, b in zip(PC, PR)], [a - b for a, b in zip(RC, RR)], eps), abs=1e-6)
    with pytest.warns(UserWarning, match="ignored"):  # said once, where the knobs are checked
        validate_loss_config("hinge", None, BETA, eps)


def test_bco_delta_is_subtracted():
    d = 0.05
    expected = per_example(lambda c, r, z, i: -logsig(BETA * c - d) - logsig(-(BETA * r - d)))
    assert run("bco_pair", bco_delta=d)[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert run("bco_pair", bco_delta=torch.tensor(d))[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_lengths_required_for_ipo_and_sft():
    for loss_type in ("ipo", "sft"):
        with pytest.raises(ValueError, match="chosen_lengths"):
            dpo_loss(t(PC), t(PR), t(RC), t(RR), loss_type=loss_type)


def test_sigmoid_gradient_sign():
    pc = torch.tensor(PC, requires_grad=True)
    losses, chosen, _ = dpo_loss(pc, torch.tensor(PR), torch.tensor(RC), torch.tensor(RR), beta=BETA)
    losses.sum().backward()
    assert (pc.grad < 0).all()
    assert chosen.grad_fn is None


def test_low_precision_inputs_computed_in_float32():
    args = [torch.tensor(v, dtype=torch.bfloat16) for v in (PC, PR, RC, RR)]
    losses, chosen, _ = dpo_loss(*args, beta=BETA)
    assert losses.dtype == torch.float32 and chosen.dtype == torch.float32
    exact, _, _ = dpo_loss(*[a.double() for a in args], beta=BETA)
    assert torch.allclose(losses.double(), exact, atol=1e-6)


def test_length_desensitized_logps_hand_example():
    inf = float("inf")
    # row 0: chosen has 3 completion tokens (from offset 1), rejected 2 -> shared 2
    # row 1: chosen has 1 token, rejected 3 (from offset 0) -> shared 1; -inf under the mask is never read
    lc = torch.tensor([[-inf, -1.0, -2.0, -3.0, 0.0], [-5.0, -5.0, -5.0, -0.5, 0.0]])
    mc = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 0, 1, 0]])
    lr = torch.tensor([[-7.0, -7.0, -0.25, -0.75], [-1.5, -2.5, -4.0, -inf]])
    mr = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    a = 0.5
    c, r = length_desensitized_logps(lc, mc, lr, mr, a)
    assert c.tolist() == pytest.approx([-1.0 - 2.0 + a * -3.0, -0.5], abs=1e-6)
    assert r.tolist() == pytest.approx([-0.25 - 0.75, -1.5 + a * (-2.5 - 4.0)], abs=1e-6)
    c1, r1 = length_desensitized_logps(lc, mc, lr, mr, 1.0)
    assert c1.tolist() == pytest.approx([-6.0, -0.5], abs=1e-6)
    assert r1.tolist() == pytest.approx([-1.0, -8.0], abs=1e-6)
    c0, r0 = length_desensitized_logps(lc, mc, lr, mr, 0.0)
    assert c0.tolist() == pytest.approx([-3.0, -0.5], abs=1e-6)
    assert r0.tolist() == pytest.approx([-1.0, -1.5], abs=1e-6)
    with pytest.raises(ValueError, match="ld_alpha"):  # refused once, where it is configured
        DPOLossConfig(ld_alpha=1.5)


def test_validate_loss_config_errors():
    assert validate_loss_config("ipo", None, 0.1, 0.0) == ["ipo"]
    assert validate_loss_config(("sigmoid", "sft"), [1.0, 0.5], 0.1, 0.0) == ["sigmoid", "sft"]
    with pytest.raises(ValueError, match="valid names are:.*'sigmoid'.*'discopop'.*'sft'") as err:
        validate_loss_config("dpo", None, 0.1, 0.0)
    assert "'dpo'" in str(err.value)
    with pytest.raises(ValueError, match="beta"):
        validate_loss_config("sigmoid", None, 0.0, 0.0)
    with pytest.raises(ValueError, match="beta"):
        validate_loss_config("sigmoid", None, -1.0, 0.0)
    for eps in (0.5, -0.1):
        with pytest.raises(ValueError, match="label_smoothing"):
            validate_loss_config("robust", None, 0.1, eps)
    with pytest.raises(ValueError, match="loss_weights"):
        validate_loss_config(["sigmoid", "ipo"], [1.0], 0.1, 0.0)
    with pytest.raises(ValueError, match="exo_pair"):
        validate_loss_config("exo_pair", None, 0.1, 0.0)
    with pytest.raises(ValueError, match="valid names"):
        dpo_loss(t(PC), t(PR), t(RC), t(RR), loss_type=["sigmoid", "kto_pair"])


def test_sft_term_with_ld_alpha_is_the_plain_token_nll(monkeypatch, tiny_model):
    """One pair: chosen has 4 tokens of log-prob -1, rejected 1 token. With ld_alpha=0 the compared chosen
    log-prob keeps only the shared first token (-1), but the sft term is the mean NLL of all 4 chosen tokens:
    4 / 4 = 1.00 (reading the weighted sum would give 1 / 4 = 0.25)."""
    import lightalign.modules.dpo as dpo_module
    from lightalign.modules.dpo import DPOModule

    token_logps = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-1.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    monkeypatch.setattr(dpo_module, "completion_token_logps", lambda model, batch: (token_logps, mask))
    batch = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "attention_mask": torch.ones(2, 6, dtype=torch.long),
             "completion_mask": torch.tensor([[0, 1, 1, 1, 1, 0], [0, 1, 0, 0, 0, 0]])}
    module = DPOModule(model=tiny_model, loss_type="sft", ld_alpha=0.0, reference_free=True)
    assert module._step(batch, module.train_stats).item() == pytest.approx(1.0, abs=1e-6)
    # the pure function: the weighted sums feed the preference terms, the plain sums the NLL
    losses, _, _ = dpo_loss(t([-1.0]), t([-1.0]), None, None, loss_type="sft", reference_free=True,
                            chosen_lengths=torch.tensor([4]), chosen_token_logp_sums=t([-4.0]))
    assert losses.tolist() == pytest.approx([1.0])


def test_module_step_loss_is_the_mean_over_pairs(monkeypatch, tiny_model):
    """DPOModule's training loss is the mean of the per-pair losses (a sum would scale the step with the batch
    size and break accumulation's equivalence), by hand: pairs with log-ratios (c - r) = 1 and -2, beta 0.5."""
    import lightalign.modules.dpo as dpo_module
    from lightalign.modules.dpo import DPOModule

    # rows: chosen 0, chosen 1, rejected 0, rejected 1 (policy log-probs; reference_free: reference 0)
    token_logps = torch.tensor([[-1.0, -1.0], [-3.0, 0.0], [-3.0, 0.0], [-0.5, -0.5]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1]])
    monkeypatch.setattr(dpo_module, "completion_token_logps", lambda model, batch: (token_logps, mask))
    batch = {"input_ids": torch.zeros(4, 4, dtype=torch.long), "attention_mask": torch.ones(4, 4, dtype=torch.long),
             "completion_mask": torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0]])}
    module = DPOModule(model=tiny_model, beta=0.5, reference_free=True)
    expected = (-logsig(0.5 * (-2.0 + 3.0)) - logsig(0.5 * (-3.0 + 1.0))) / 2
    assert module._step(batch, module.train_stats).item() == pytest.approx(expected, abs=1e-6)
