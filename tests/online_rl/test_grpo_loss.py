"""grpo_loss against hand computations (plain ``math`` on Python floats) for each TRL loss type, the k3 KL term,
the clip-ratio stats, gradient-accumulation equivalence under Lightning's division, and the config errors."""

from __future__ import annotations

import math

import pytest
import torch

from lightalign.modules.losses.grpo import grpo_loss

from helpers.grpo_knobs import check_grpo_knobs

CLASSIC_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # the new types: tests/online_rl/test_grpo_loss_types.py

EPS, EPS_HIGH = 0.2, 0.28
# Three completions of lengths 4, 2, 3 (T = 4). OLD are the generation-time log-probs; DELTA = LOGP - OLD on real
# tokens. With epsilon 0.2 / epsilon_high 0.28 the ratios are chosen so that:
#   row 0 (A=+1.0): t1 r=e^0.4 > 1.28 -> high-clipped; t2 r=e^-0.5 < 0.8 but A > 0 -> NOT clipped (min keeps r*A)
#   row 1 (A=-0.5): t0 r=e^-0.4 < 0.8 -> low-clipped; t1 r=e^0.3 > 1.28 but A < 0 -> NOT clipped
#   row 2 (A=+2.0): t0 r=e^0.3 > 1.28 -> high-clipped
LENGTHS = [4, 2, 3]
ADV = [1.0, -0.5, 2.0]
OLD = [[-1.0, -2.0, -0.5, -1.5], [-0.7, -1.2, 0.0, 0.0], [-2.0, -0.3, -1.1, 0.0]]
DELTA = [[0.0, 0.4, -0.5, 0.1], [-0.4, 0.3, None, None], [0.3, -0.1, 0.2, None]]
REF = [[-1.1, -1.6, -1.2, -1.0], [-1.0, -0.8, 0.0, 0.0], [-1.5, -0.6, -0.7, 0.0]]
MAX_LEN = 6


def logp_values():
    return [[o + d if d is not None else float("nan") for o, d in zip(orow, drow)] for orow, drow in zip(OLD, DELTA)]


def inputs(pad=float("nan")):
    """Tensors (float64); padded positions of the current log-probs hold ``pad`` (never read)."""
    logp = torch.tensor(logp_values(), dtype=torch.float64)
    mask = torch.tensor([[1 if t < n else 0 for t in range(4)] for n in LENGTHS])
    logp = torch.where(mask.bool(), logp, torch.full_like(logp, pad)).requires_grad_(True)
    return logp, torch.tensor(OLD, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64), mask


def hand_token_losses(beta=0.0):
    """Per-row lists of per-token losses: -min(r*A, clip(r, 1-eps, 1+eps_high)*A) + beta*k3."""
    rows = []
    for i, n in enumerate(LENGTHS):
        row = []
        for t in range(n):
            r = math.exp(DELTA[i][t])
            clipped = min(max(r, 1 - EPS), 1 + EPS_HIGH)
            value = -min(r * ADV[i], clipped * ADV[i])
            if beta:
                x = REF[i][t] - (OLD[i][t] + DELTA[i][t])
                value += beta * (math.exp(x) - x - 1)
            row.append(value)
        rows.append(row)
    return rows


def hand_loss(loss_type, beta=0.0, num_items=None):
    rows = hand_token_losses(beta)
    total = sum(sum(r) for r in rows)
    if loss_type == "grpo":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    if loss_type == "bnpo":
        return total / sum(LENGTHS)
    if loss_type == "dr_grpo":
        return total / (len(rows) * MAX_LEN)
    return total / (sum(LENGTHS) if num_items is None else num_items)  # dapo


def run(loss_type, beta=0.0, **kw):
    logp, old, adv, mask = inputs()
    ref = torch.tensor(REF, dtype=torch.float64) if beta else None
    kw.setdefault("use_bias_correction_kl", False)
    loss, stats = grpo_loss(logp, old, adv, mask, loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH,
                            beta=beta, ref_per_token_logps=ref, max_completion_length=MAX_LEN, **kw)
    return logp, loss, stats


@pytest.mark.parametrize("loss_type", CLASSIC_LOSS_TYPES)
def test_each_loss_type_matches_hand_computation(loss_type):
    logp, loss, _ = run(loss_type)
    assert loss.item() == pytest.approx(hand_loss(loss_type), abs=1e-12)
    loss.backward()  # nan under the mask is never read: finite loss, zero gradient there
    assert torch.isfinite(logp.grad).all()
    mask = inputs()[3].bool()
    assert (logp.grad[~mask] == 0).all()


def test_loss_types_really_differ_on_this_example():
    values = {t: hand_loss(t) for t in ("grpo", "bnpo", "dr_grpo")}
    assert len({round(v, 9) for v in values.values()}) == 3
    assert hand_loss("dapo") == hand_loss("bnpo")  # dapo defaults to the local token count


def test_dapo_uses_num_items_in_batch_and_bnpo_ignores_it():
    _, loss, _ = run("dapo", num_items_in_batch=torch.tensor(20))
    assert loss.item() == pytest.approx(hand_loss("dapo", num_items=20), abs=1e-12)
    _, loss, _ = run("bnpo", num_items_in_batch=20)
    assert loss.item() == pytest.approx(hand_loss("bnpo"), abs=1e-12)


@pytest.mark.parametrize("loss_type", CLASSIC_LOSS_TYPES)
def test_kl_term_k3(loss_type):
    beta = 0.1
    _, loss, stats = run(loss_type, beta=beta)
    assert loss.item() == pytest.approx(hand_loss(loss_type, beta=beta), abs=1e-12)
    k3 = [math.exp(REF[i][t] - OLD[i][t] - DELTA[i][t]) - (REF[i][t] - OLD[i][t] - DELTA[i][t]) - 1
          for i, n in enumerate(LENGTHS) for t in range(n)]
    assert stats["kl"].item() == pytest.approx(sum(k3) / len(k3), abs=1e-12)
    assert all(v >= 0 for v in k3) and not stats["kl"].requires_grad


def test_no_kl_stat_without_beta():
    _, _, stats = run("dapo")
    assert "kl" not in stats


def test_clip_ratio_stats():
    _, _, stats = run("dapo")
    n = sum(LENGTHS)  # 9 real tokens: 1 low-clipped (row 1 t0), 2 high-clipped (row 0 t1, row 2 t0)
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(1 / n)
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(2 / n)
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(3 / n)


def test_clipped_tokens_get_no_gradient_and_others_do():
    logp, loss, _ = run("bnpo")
    loss.backward()
    g = logp.grad
    n = sum(LENGTHS)
    assert g[0, 1] == 0 and g[1, 0] == 0 and g[2, 0] == 0  # clipped branch active
    # unclipped: d/dlogp of -r*A / n = -r*A / n
    assert g[0, 2].item() == pytest.approx(-math.exp(-0.5) * 1.0 / n, abs=1e-12)
    assert g[1, 1].item() == pytest.approx(-math.exp(0.3) * -0.5 / n, abs=1e-12)


def test_epsilon_high_defaults_to_epsilon():
    logp, old, adv, mask = inputs(pad=0.0)
    a, sa = grpo_loss(logp, old, adv, mask, epsilon=EPS)
    b, sb = grpo_loss(logp, old, adv, mask, epsilon=EPS, epsilon_high=EPS)
    assert a.item() == b.item() and sa["clip_ratio/high_mean"].item() == sb["clip_ratio/high_mean"].item()
    # at 1 + 0.2, row 2 t2 (r = e^0.2 = 1.22, A > 0) is high-clipped too; at 1 + 0.28 it is not
    assert sa["clip_ratio/high_mean"].item() == pytest.approx(3 / 9)
    _, sc = grpo_loss(logp, old, adv, mask, epsilon=EPS, epsilon_high=EPS_HIGH)
    assert sc["clip_ratio/high_mean"].item() == pytest.approx(2 / 9)


def test_on_policy_gradient_sign_and_mask():
    """old=None -> ratio 1: with A > 0 raising a real token's log-prob lowers the loss; padding gets exactly 0."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.0, -9.0, -9.0]], dtype=torch.float64,
                        requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv = torch.tensor([0.5, 1.5], dtype=torch.float64)
    for loss_type in CLASSIC_LOSS_TYPES:
        logp.grad = None
        loss, stats = grpo_loss(logp, None, adv, mask, loss_type=loss_type, max_completion_length=4)
        loss.backward()
        assert (logp.grad[mask.bool()] < 0).all(), loss_type
        assert (logp.grad[~mask.bool()] == 0).all(), loss_type
        assert stats["clip_ratio/region_mean"].item() == 0.0
    # dapo on-policy: loss = -sum(A_i * n_i) / N, gradient -A_i / N per real token
    logp.grad = None
    loss, _ = grpo_loss(logp, None, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(-(0.5 * 3 + 1.5 * 2) / 5)
    assert logp.grad[0, 0].item() == pytest.approx(-0.5 / 5) and logp.grad[1, 1].item() == pytest.approx(-1.5 / 5)


def test_ratio_uses_old_logps_and_float32_for_half_inputs():
    logp, old, adv, mask = inputs(pad=0.0)
    loss, _ = grpo_loss(logp.detach().to(torch.bfloat16).requires_grad_(), old.to(torch.bfloat16),
                        adv.float(), mask, loss_type="bnpo", epsilon=EPS, epsilon_high=EPS_HIGH)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(hand_loss("bnpo"), abs=2e-2)


# ------------------------------------------------------------------------------------- gradient accumulation
def accumulation_batch():
    g = torch.Generator().manual_seed(0)
    B, T = 8, 5
    logp = (-3 * torch.rand(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = logp.detach() + 0.6 * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)  # some get clipped
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 1, 3])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return logp, old, adv, mask


def grad_of(fn, logp):
    logp.grad = None
    fn().backward()
    return logp.grad.clone()


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_accumulation_of_four_micro_batches_equals_one_batch(loss_type):
    logp, old, adv, mask = accumulation_batch()
    K = 4
    kw = dict(loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, beta=0.05, ref_per_token_logps=old - 0.1,
              max_completion_length=5, use_bias_correction_kl=False)
    _, stats = grpo_loss(logp, old, adv, mask, **kw)
    assert stats["clip_ratio/region_mean"] > 0  # the clipped branch is exercised
    full = grad_of(lambda: grpo_loss(logp, old, adv, mask, **kw)[0], logp)
    total_tokens = mask.sum()

    def accumulated():
        out = 0
        for k in range(K):
            s = slice(2 * k, 2 * k + 2)
            ck = dict(kw, ref_per_token_logps=kw["ref_per_token_logps"][s])
            if loss_type == "dapo":  # global token count, times K; then Lightning divides by K
                loss = grpo_loss(logp[s], old[s], adv[s], mask[s], num_items_in_batch=total_tokens, **ck)[0] * K
            else:
                loss = grpo_loss(logp[s], old[s], adv[s], mask[s], **ck)[0]
            out = out + loss / K  # Lightning's division by accumulate_grad_batches
        return out

    torch.testing.assert_close(grad_of(accumulated, logp), full, atol=1e-6, rtol=0)


def test_bnpo_is_not_accumulation_invariant_with_unequal_lengths():
    """bnpo normalises by each micro-batch's own token count (as TRL): mean_k(S_k/N_k) != sum S_k / sum N_k."""
    logp, old, adv, mask = accumulation_batch()
    kw = dict(loss_type="bnpo", epsilon=EPS, epsilon_high=EPS_HIGH)
    full_loss = grpo_loss(logp, old, adv, mask, **kw)[0]
    full = grad_of(lambda: grpo_loss(logp, old, adv, mask, **kw)[0], logp)
    chunks = [grpo_loss(logp[2 * k:2 * k + 2], old[2 * k:2 * k + 2], adv[2 * k:2 * k + 2], mask[2 * k:2 * k + 2],
                        **kw)[0] for k in range(4)]
    accumulated = grad_of(lambda: sum(grpo_loss(logp[2 * k:2 * k + 2], old[2 * k:2 * k + 2], adv[2 * k:2 * k + 2],
                                                mask[2 * k:2 * k + 2], **kw)[0] / 4 for k in range(4)), logp)
    assert abs(sum(c.item() for c in chunks) / 4 - full_loss.item()) > 1e-3
    assert (accumulated - full).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(loss_type="ppo"), "valid names are: 'grpo', 'bnpo', 'dr_grpo', 'dapo'"),
        (dict(epsilon=0.0), "epsilon"),
        (dict(epsilon=-0.1), "must be > 0"),
        (dict(epsilon_high=0.1), "epsilon_high must be >= epsilon"),
        (dict(beta=-0.01), "beta"),
        (dict(loss_type="dr_grpo", max_completion_length=None), "max_completion_length"),
        (dict(loss_type="dr_grpo", max_completion_length=0), "max_completion_length"),
    ],
)
def test_validate_config_errors(kwargs, message):
    args = dict(loss_type="dapo", epsilon=0.2, epsilon_high=None, beta=0.0, max_completion_length=None) | kwargs
    with pytest.raises(ValueError, match=message):
        check_grpo_knobs(**args)


def test_validate_config_accepts_trl_defaults_and_dapo_paper_setting():
    check_grpo_knobs("dapo", 0.2, None, 0.0, None)
    check_grpo_knobs("dapo", 0.2, 0.28, 0.04, None)
    check_grpo_knobs("dr_grpo", 0.2, 0.2, 0.0, 256)


def test_grpo_loss_input_errors():
    logp, old, adv, mask = inputs(pad=0.0)
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        grpo_loss(logp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match=r"advantages must be \[B\]"):
        grpo_loss(logp, old, adv[:2], mask)
    with pytest.raises(ValueError, match="completion_mask"):
        grpo_loss(logp, old, adv, mask[:, :3])
    with pytest.raises(ValueError, match="Unknown GRPO loss_type"):
        grpo_loss(logp, old, adv, mask, loss_type="gspo")
