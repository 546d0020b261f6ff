"""The DPO loss knobs of TRL 1.16 added to dpo_loss: f_divergence_type / f_alpha_divergence_coef (f-DPO) and
use_weighting (WPO), each against hand computations with plain ``math``."""

from __future__ import annotations

import math

import pytest
import torch

from lightalign.modules.dpo import dpo_loss, f_divergence_scores, validate_loss_config, wpo_weights
from lightalign.modules.logprobs import log_sum_squared_probs

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
