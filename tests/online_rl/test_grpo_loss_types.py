"""The loss types and knobs grpo_loss gained for TRL parity (cispo, sapo, luspo, vespo, GSPO's sequence-level
ratio, delta, the off-policy mask, the bias-corrected KL, the entropy mask and bonus), each against a hand
computation with ``math`` on Python floats, and their gradients where the formula says what they must be."""

from __future__ import annotations

import math

import pytest
import torch

from lightalign.modules.losses.entropy import high_entropy_mask
from lightalign.modules.losses.grpo import grpo_loss

from helpers.grpo_knobs import check_grpo_knobs

# Two completions of lengths 3 and 2 (T = 3). DELTA = logp - old on real tokens.
ADV = [1.0, -0.5]
OLD = [[-1.0, -2.0, -0.5], [-0.7, -1.2, 0.0]]
DELTA = [[0.1, -0.3, 0.5], [0.2, -0.4, None]]
REF = [[-1.2, -1.5, -0.9], [-0.4, -1.0, 0.0]]
LENGTHS = [3, 2]
N = sum(LENGTHS)


def logp_of(i, t):
    return OLD[i][t] + DELTA[i][t]


def tensors():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    logp = torch.tensor([[logp_of(0, t) for t in range(3)], [logp_of(1, 0), logp_of(1, 1), float("nan")]],
                        dtype=torch.float64, requires_grad=True)
    return logp, torch.tensor(OLD, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64), mask


def run(**kw):
    logp, old, adv, mask = tensors()
    kw.setdefault("epsilon", 0.2)
    kw.setdefault("use_bias_correction_kl", False)
    loss, stats = grpo_loss(logp, old, adv, mask, **kw)
    loss.backward()
    return loss.item(), logp.grad, stats


def tokens():
    return [(i, t) for i in range(2) for t in range(LENGTHS[i])]


def test_cispo_caps_and_detaches_the_ratio():
    cap = 1.2  # r = e^0.5 (row 0) and e^0.2 (row 1) exceed it
    loss, grad, stats = run(loss_type="cispo", epsilon_high=cap)
    want = sum(-min(math.exp(DELTA[i][t]), cap) * ADV[i] * logp_of(i, t) for i, t in tokens()) / N
    assert loss == pytest.approx(want, abs=1e-12)
    for i, t in tokens():  # the weight is detached: d/dlogp = -min(r, cap) A / N, also on capped tokens
        assert grad[i, t].item() == pytest.approx(-min(math.exp(DELTA[i][t]), cap) * ADV[i] / N, abs=1e-12)
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / N)  # only row 0's token 2 (A > 0)


def test_sapo_soft_gate_and_its_gradient():
    tp, tn = 1.0, 1.05
    loss, grad, _ = run(loss_type="sapo", sapo_temperature_pos=tp, sapo_temperature_neg=tn)

    def sig(x):
        return 1 / (1 + math.exp(-x))

    rows = []
    for i in range(2):
        tau = tp if ADV[i] > 0 else tn
        rows.append(sum(-4 / tau * sig(tau * (math.exp(DELTA[i][t]) - 1)) * ADV[i] for t in range(LENGTHS[i]))
                    / LENGTHS[i])
    assert loss == pytest.approx(sum(rows) / 2, abs=1e-12)
    for i, t in tokens():
        tau = tp if ADV[i] > 0 else tn
        r = math.exp(DELTA[i][t])
        s = sig(tau * (r - 1))
        assert grad[i, t].item() == pytest.approx(-4 * s * (1 - s) * r * ADV[i] / LENGTHS[i] / 2, abs=1e-12)


def seq_ratio(i):
    return math.exp(sum(DELTA[i][t] for t in range(LENGTHS[i])) / LENGTHS[i])


def clipped_seq_loss(i, eps=0.2):
    r = seq_ratio(i)
    return -min(r * ADV[i], min(max(r, 1 - eps), 1 + eps) * ADV[i])


def test_gspo_sequence_level_ratio_with_grpo_reduction():
    loss, grad, _ = run(loss_type="grpo", importance_sampling_level="sequence")
    assert loss == pytest.approx((clipped_seq_loss(0) + clipped_seq_loss(1)) / 2, abs=1e-12)
    # row 0: r = e^0.1 inside the clip range -> every token gets d/dlogp = -r A / n_0 / B (mean log-ratio)
    for t in range(3):
        assert grad[0, t].item() == pytest.approx(-seq_ratio(0) * ADV[0] / 3 / 2, abs=1e-12)


def test_luspo_scales_each_sequence_loss_by_its_length():
    loss, _, _ = run(loss_type="luspo", importance_sampling_level="sequence")
    assert loss == pytest.approx((clipped_seq_loss(0) * 3 + clipped_seq_loss(1) * 2) / 2, abs=1e-12)


# LUSPO with the KL term and the high-entropy token mask, against TRL 1.16.0's reduction written by hand: per token
# ``L_i * e_it + beta * k3_it`` (``L_i`` the clipped sequence-ratio loss of row i, ``e`` the entropy mask, ``k3`` on
# every real token), masked by the completion mask, summed over each row, averaged over the rows.
LUSPO_MASK = [[1, 1, 1, 1, 1, 1],  # lengths 6, 4, 1, 4 (a zero inside: a tool-output token), 3 and an empty row
              [1, 1, 1, 1, 0, 0],
              [1, 0, 0, 0, 0, 0],
              [1, 1, 0, 1, 1, 0],
              [1, 1, 1, 0, 0, 0],
              [0, 0, 0, 0, 0, 0]]
LUSPO_ADV = [1.3, -0.8, 0.45, -1.6, 0.9, 0.7]


def luspo_tensors():
    g = torch.Generator().manual_seed(1234)
    shape = (len(LUSPO_MASK), len(LUSPO_MASK[0]))
    mask = torch.tensor(LUSPO_MASK)
    old = -3 * torch.rand(shape, generator=g, dtype=torch.float64)
    logp = old + 0.6 * torch.randn(shape, generator=g, dtype=torch.float64)  # sequence ratios inside and outside
    ref = logp + 0.5 * torch.randn(shape, generator=g, dtype=torch.float64)
    entropies = 2 * torch.rand(shape, generator=g, dtype=torch.float64)
    pad = ~mask.bool()  # values under the mask are never read
    logp, old = logp.masked_fill(pad, float("nan")), old.masked_fill(pad, float("nan"))
    ref = ref.masked_fill(pad, -math.inf)
    return logp.requires_grad_(), old, ref, torch.tensor(LUSPO_ADV, dtype=torch.float64), mask, entropies


def luspo_by_hand(logp, old, ref, adv, mask, keep, beta, eps=0.2, eps_high=0.28):
    """Element by element, reading real tokens only; returns a tensor so that autograd gives its gradient."""
    rows = []
    for i in range(mask.shape[0]):
        real = [t for t in range(mask.shape[1]) if mask[i, t]]
        log_r = sum((logp[i, t] - old[i, t] for t in real), torch.zeros((), dtype=torch.float64)) / max(len(real), 1)
        r, a = torch.exp(log_r), adv[i].item()
        seq_loss = -torch.minimum(r * a, torch.clamp(r, 1 - eps, 1 + eps_high) * a)
        row = torch.zeros((), dtype=torch.float64)
        for t in real:
            x = ref[i, t] - logp[i, t]
            row = row + seq_loss * float(keep[i, t]) + beta * (torch.exp(x) - x - 1)
        rows.append(row)
    return sum(rows) / len(rows)  # every row counts, the empty one with 0


@pytest.mark.parametrize("beta, top_entropy_quantile", [(0.04, 1.0), (0.0, 0.4), (0.04, 0.4)])
def test_luspo_with_kl_and_entropy_mask_matches_trl_formula(beta, top_entropy_quantile):
    logp, old, ref, adv, mask, entropies = luspo_tensors()
    check_grpo_knobs("luspo", 0.2, 0.28, beta, None, importance_sampling_level="sequence",
                              top_entropy_quantile=top_entropy_quantile)
    keep = mask.bool() if top_entropy_quantile >= 1 else high_entropy_mask(entropies, mask, top_entropy_quantile)
    if top_entropy_quantile < 1:
        assert 0 < keep.sum() < mask.sum()  # the mask drops some real tokens
    # the entropy mask passed is True on the padding too: the completion mask alone must keep padding out of the sums
    loss, stats = grpo_loss(logp, old, adv, mask, loss_type="luspo", importance_sampling_level="sequence",
                            epsilon=0.2, epsilon_high=0.28, beta=beta, ref_per_token_logps=ref if beta else None,
                            use_bias_correction_kl=False,
                            entropy_mask=None if top_entropy_quantile >= 1 else keep | ~mask.bool())
    assert stats["clip_ratio/region_mean"] > 0  # some rows' sequence ratios are clipped, others are not
    loss.backward()
    grad, logp.grad = logp.grad, None
    want = luspo_by_hand(logp, old, ref, adv, mask, keep, beta)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-12)
    want.backward()
    torch.testing.assert_close(grad, logp.grad, rtol=1e-10, atol=1e-12)
    assert (grad[~mask.bool()] == 0).all()


def test_vespo_gamma_weight():
    k_pos, l_pos, k_neg, l_neg = 2.0, 3.0, 3.0, 2.0
    loss, grad, stats = run(loss_type="vespo")
    phis = []
    for i in range(2):
        log_w = sum(DELTA[i][t] for t in range(LENGTHS[i]))
        k, lam = (k_pos, l_pos) if ADV[i] >= 0 else (k_neg, l_neg)
        phis.append(math.exp(lam) * math.exp(log_w) ** k * math.exp(-lam * math.exp(log_w)))
    want = sum(-phis[i] * ADV[i] * logp_of(i, t) for i, t in tokens()) / N
    assert loss == pytest.approx(want, abs=1e-12)
    for i, t in tokens():  # phi is a detached coefficient
        assert grad[i, t].item() == pytest.approx(-phis[i] * ADV[i] / N, abs=1e-12)
    assert stats["vespo/phi_seq_mean"].item() == pytest.approx(sum(phis) / 2)


def test_delta_caps_the_unclipped_branch():
    # row 1, token 0: A = -0.5, r = e^0.2 = 1.221 > delta = 1.15 -> -min(1.15 A, 1.2 A) = 0.6, no gradient;
    # without delta -min(r A, 1.2 A) = 0.5 r with gradient 0.5 r / N. Row 0, token 2: A = 1, r = e^0.5 -> -1.15
    # instead of -1.2 (clipped either way).
    r = math.exp(0.2)
    _, grad, _ = run(loss_type="dapo", delta=1.15)
    assert grad[1, 0].item() == 0.0
    loss_plain, grad_plain, _ = run(loss_type="dapo")
    assert grad_plain[1, 0].item() == pytest.approx(0.5 * r / N, abs=1e-12)
    loss_delta, _, _ = run(loss_type="dapo", delta=1.15)
    assert loss_plain - loss_delta == pytest.approx((0.5 * r - 0.6 - 0.05) / N, abs=1e-12)


def test_off_policy_mask_drops_negative_advantage_rows_beyond_the_threshold():
    # row 1 (A < 0): mean(old - logp) = mean(-0.2, 0.4) = 0.1; row 0 has A > 0 and is always kept.
    _, grad_kept, _ = run(loss_type="dapo", off_policy_mask_threshold=0.15)
    _, grad_dropped, _ = run(loss_type="dapo", off_policy_mask_threshold=0.05)
    assert grad_kept[1, :2].abs().sum() > 0
    assert grad_dropped[1, :2].abs().sum() == 0
    torch.testing.assert_close(grad_dropped[0], grad_kept[0])


def k3(i, t):
    x = REF[i][t] - logp_of(i, t)
    return math.exp(x) - x - 1


def test_bias_corrected_kl_multiplies_k3_by_the_ratio():
    beta = 0.1
    ref = torch.tensor(REF, dtype=torch.float64)
    plain, _, _ = run(loss_type="dapo", beta=beta, ref_per_token_logps=ref)
    corrected, grad, stats = run(loss_type="dapo", beta=beta, ref_per_token_logps=ref, use_bias_correction_kl=True)
    diff = sum(beta * k3(i, t) * (math.exp(DELTA[i][t]) - 1) for i, t in tokens()) / N
    assert corrected - plain == pytest.approx(diff, abs=1e-12)
    # row 0 token 0: r = e^0.1 inside the clip range; d/dlogp of [-r A + beta r k3] with dk3/dlogp = 1 - e^x
    i, t = 0, 0
    r, x = math.exp(DELTA[i][t]), REF[i][t] - logp_of(i, t)
    want = (-r * ADV[i] + beta * (r * k3(i, t) + r * (1 - math.exp(x)))) / N
    assert grad[i, t].item() == pytest.approx(want, abs=1e-12)
    assert stats["kl"].item() == pytest.approx(sum(k3(i, t) * math.exp(DELTA[i][t]) for i, t in tokens()) / N)


def test_entropy_mask_removes_the_policy_gradient_but_not_the_kl():
    keep = torch.tensor([[1, 0, 1], [1, 0, 0]], dtype=torch.bool)
    _, grad, _ = run(loss_type="dapo", entropy_mask=keep)
    _, grad_all, _ = run(loss_type="dapo")
    assert grad_all[0, 1].item() != 0.0 and grad[0, 1].item() == 0.0  # (0, 1): r < 1 - eps but A > 0: not clipped
    assert grad[0, 0].item() == grad_all[0, 0].item() != 0.0 and grad[1, 0].item() == grad_all[1, 0].item() != 0.0
    ref = torch.tensor(REF, dtype=torch.float64)
    _, grad_kl, _ = run(loss_type="dapo", entropy_mask=keep, beta=0.1, ref_per_token_logps=ref)
    x = REF[0][1] - logp_of(0, 1)
    assert grad_kl[0, 1].item() == pytest.approx(0.1 * (1 - math.exp(x)) / N, abs=1e-12)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_entropy_bonus(loss_type):
    values = [[2.0, 1.0, 3.0], [0.5, 1.5, 9.0]]  # 9.0 sits under the padding mask
    keep = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    coef = 0.3
    logp, old, adv, mask = tensors()
    base, _ = grpo_loss(logp, old, adv, mask, loss_type=loss_type)
    ent = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    loss, stats = grpo_loss(logp, old, adv, mask, loss_type=loss_type, entropies=ent, entropy_mask=keep,
                            entropy_coef=coef)
    masked_base, _ = grpo_loss(logp, old, adv, mask, loss_type=loss_type, entropy_mask=keep)
    selected = [(0, 0), (0, 2), (1, 0), (1, 1)]
    denom = len(selected)  # every loss type: the micro-batch's mean over the selected tokens (TRL 1.16)
    h = sum(values[i][t] for i, t in selected) / denom
    assert stats["entropy_bonus"].item() == pytest.approx(h)
    assert loss.item() == pytest.approx(masked_base.item() - coef * h, abs=1e-12)
    loss.backward()
    want = torch.zeros(2, 3, dtype=torch.float64)
    for i, t in selected:
        want[i, t] = -coef / denom
    torch.testing.assert_close(ent.grad, want)
    assert base.item() != masked_base.item()
    # the caller's rescale of dapo-like losses (x accumulate_grad_batches) is taken out of the bonus
    scaled, _ = grpo_loss(logp, old, adv, mask, loss_type=loss_type, entropies=ent.detach(), entropy_mask=keep,
                          entropy_coef=coef, loss_scale=4.0)
    assert scaled.item() == pytest.approx(masked_base.item() - coef * h / 4.0, abs=1e-12)


@pytest.mark.parametrize("kwargs, message", [
    (dict(loss_type="cispo"), "set epsilon_high explicitly"),
    (dict(loss_type="luspo"), "needs importance_sampling_level='sequence'"),
    (dict(loss_type="vespo", importance_sampling_level="sequence"), "leave importance_sampling_level='token'"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level='seq' is unknown"),
    (dict(delta=0.9), "delta caps"),
    (dict(loss_type="sapo", delta=4.0), "delta \\(two-sided clipping\\) applies"),
    (dict(sapo_temperature_neg=0.0), "sapo_temperature_neg must be > 0"),
    (dict(vespo_lambda_pos=-1.0), "vespo_lambda_pos must be > 0"),
    (dict(vespo_k_neg=-1.0), "vespo_k_neg"),
    (dict(off_policy_mask_threshold=0.0), "off_policy_mask_threshold must be > 0"),
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile must be in \\[0, 1\\]"),
    (dict(entropy_coef=-0.1), "entropy_coef must be >= 0"),
])
def test_new_knob_errors(kwargs, message):
    kw = dict(loss_type="dapo", epsilon=0.2, epsilon_high=None, beta=0.0, max_completion_length=8)
    kw.update(kwargs)
    positional = [kw.pop(k) for k in ("loss_type", "epsilon", "epsilon_high", "beta", "max_completion_length")]
    with pytest.raises(ValueError, match=message):
        check_grpo_knobs(*positional, **kw)
