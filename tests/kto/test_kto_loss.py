"""``kto_loss`` and ``kl_estimate`` (pure functions) against hand computations on small tensors; the knob checks;
TRL's class-balance warning."""

from __future__ import annotations

import math

import pytest
import torch

from lightalign.modules.kto import balance_warning
from lightalign.modules.losses.kto import kl_estimate, kto_loss, validate_kto_config


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


POLICY = [-3.0, -5.0, -2.0, -7.5]
REF = [-4.0, -4.5, -2.5, -7.0]  # log-ratios 1.0, -0.5, 0.5, -0.5
LABELS = [True, False, True, False]


def test_kto_loss_by_hand():
    beta, kl, wd, wu = 0.5, 0.2, 1.5, 0.75
    loss, out = kto_loss(torch.tensor(POLICY), torch.tensor(REF), torch.tensor(LABELS), torch.tensor(kl), beta, wd, wu)
    r = [p - q for p, q in zip(POLICY, REF)]
    rows = [wd * (1 - sig(beta * (r[0] - kl))), wu * (1 - sig(beta * (kl - r[1]))),
            wd * (1 - sig(beta * (r[2] - kl))), wu * (1 - sig(beta * (kl - r[3])))]
    assert out["losses"].tolist() == pytest.approx(rows, abs=1e-6)
    assert float(loss) == pytest.approx(sum(rows) / 4, abs=1e-6)  # a mean over rows, weights not renormalised
    assert out["rewards"].tolist() == pytest.approx([beta * x for x in r], abs=1e-6)


def test_apo_zero_unpaired_by_hand_ignores_kl():
    beta = 0.3
    r = [p - q for p, q in zip(POLICY, REF)]
    rows = [1 - sig(beta * r[0]), sig(beta * r[1]), 1 - sig(beta * r[2]), sig(beta * r[3])]
    for kl in (0.0, 5.0):
        loss, out = kto_loss(torch.tensor(POLICY), torch.tensor(REF), torch.tensor(LABELS), kl, beta,
                             loss_type="apo_zero_unpaired")
        assert out["losses"].tolist() == pytest.approx(rows, abs=1e-6)
        assert float(loss) == pytest.approx(sum(rows) / 4, abs=1e-6)


def test_gradient_reaches_the_policy_log_probs_only_and_weights_scale_their_rows():
    policy = torch.tensor(POLICY, requires_grad=True)
    ref = torch.tensor(REF, requires_grad=True)
    kl = torch.tensor(0.1, requires_grad=True)
    loss, _ = kto_loss(policy, ref.detach(), torch.tensor(LABELS), kl, 0.5)
    loss.backward()
    assert kl.grad is None  # the KL estimate is a constant of the loss
    beta, r = 0.5, [p - q for p, q in zip(POLICY, REF)]
    # d/dr of (1 - sig(b(r - z))) = -b s (1 - s); of (1 - sig(b(z - r))) = +b s (1 - s)
    expected = []
    for x, desirable in zip(r, LABELS):
        s = sig(beta * (x - 0.1)) if desirable else sig(beta * (0.1 - x))
        expected.append((-1 if desirable else 1) * beta * s * (1 - s) / 4)
    assert policy.grad.tolist() == pytest.approx(expected, abs=1e-7)
    heavy = torch.tensor(POLICY, requires_grad=True)
    kto_loss(heavy, torch.tensor(REF), torch.tensor(LABELS), 0.1, 0.5, desirable_weight=3.0)[0].backward()
    assert heavy.grad[0] == pytest.approx(3 * policy.grad[0]) and heavy.grad[1] == pytest.approx(policy.grad[1])


def test_kl_estimate_is_the_detached_mean_log_ratio():
    policy = torch.tensor([-2.0, -3.0, -1.0], requires_grad=True)
    kl = kl_estimate(policy, torch.tensor([-2.5, -2.0, -1.0]))
    assert float(kl) == pytest.approx((0.5 - 1.0 + 0.0) / 3)
    assert not kl.requires_grad


@pytest.mark.parametrize("knob, kwargs", [
    ("desirable_weight", dict(desirable_weight=0.0)),
    ("undesirable_weight", dict(undesirable_weight=-1.0)),
    ("beta", dict(beta=0.0)),
    ("loss_type", dict(loss_type="sigmoid")),
])
def test_bad_knobs_are_refused(knob, kwargs):
    args = dict(loss_type="kto", beta=0.1, desirable_weight=1.0, undesirable_weight=1.0) | kwargs
    with pytest.raises(ValueError, match=knob):
        validate_kto_config(**args)


def test_balance_warning_uses_trls_ranges():
    # 606 desirable, 394 undesirable: desirable_weight in [394/606, 1.33*394/606] or undesirable in [606/394/1.33, 606/394]
    message = balance_warning(606, 394, 1.0, 1.0)
    assert "desirable_weight in [0.65, 0.86]" in message and "undesirable_weight in [1.16, 1.54]" in message
    assert balance_warning(606, 394, 1.0, 1.33) is None
    assert balance_warning(606, 394, 0.7, 1.0) is None
    assert balance_warning(500, 500, 1.0, 9.0) is None  # equal counts: no advice
