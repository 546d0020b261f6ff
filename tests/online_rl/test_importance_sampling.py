"""The sampler-mismatch importance-sampling correction (TRL 1.16's ``vllm_importance_sampling_*``): the ratio in its
four modes and the mismatch statistics against hand computations on Python floats, ``grpo_loss`` and ``rloo_loss``
with the ratio against a transcription of TRL's per-token loss, PPO's ``clipped_policy_loss`` with the ratio against
a hand computation, and the knob checks. PPO's training step with the ratio: test_ppo_importance_sampling.py."""

from __future__ import annotations

import math

import pytest
import torch

from lightalign.modules.losses.grpo import grpo_loss
from lightalign.modules.losses.ppo import clipped_policy_loss
from lightalign.modules.losses.rloo import rloo_loss
from lightalign.modules.losses.importance_sampling import (IMPORTANCE_SAMPLING_MODES, check_importance_sampling_knobs,
                                                     importance_sampling_ratio, sampling_mismatch)

NAN, INF = float("nan"), float("inf")

# ---------------------------------------------------------------------------------------------------------------
# The ratio. D = trainer - sampler on the real tokens; NAN marks a real token the sampler could not score; None is
# padding. Row 0 has a token ratio below 0.5 (e^-2), one inside, one above 3 (e^1.5); row 1's sequence ratio is
# above 3 (e^1.3); row 2's is below 0.5 (e^-0.9) and holds the unscorable token; row 3 is all padding.
D = [[-2.0, 0.3, 1.5], [0.8, 0.5, None], [-0.9, NAN, None], [None, None, None]]
SAMPLER = [[-1.0, -0.4, -2.5], [-0.6, -1.3, NAN], [-0.2, NAN, -INF], [NAN, 0.0, -INF]]
TRAINER_UNDER_PADDING = [[0.0] * 3, [0.0, 0.0, -INF], [0.0, -0.9, 7.0], [-INF, NAN, 3.0]]


def ratio_inputs(dtype=torch.float64):
    trainer, mask = [], []
    for i, row in enumerate(D):
        trainer.append([TRAINER_UNDER_PADDING[i][t] if d is None or math.isnan(d) else SAMPLER[i][t] + d
                        for t, d in enumerate(row)])
        mask.append([d is not None for d in row])
    return torch.tensor(trainer, dtype=dtype), torch.tensor(SAMPLER, dtype=dtype), torch.tensor(mask)


def real_differences(i):
    """Row i's per-token differences on its real tokens, NaN (unscorable) counted as 0."""
    return [0.0 if math.isnan(d) else d for d in D[i] if d is not None]


def constrain(raw, mode, clip_min, clip_max):
    low = -INF if clip_min is None else clip_min
    high = INF if clip_max is None else clip_max
    if mode.endswith("_mask"):
        return 0.0 if (raw < low or raw > high) else raw
    return min(max(raw, low), high)


def outside(raw, clip_min, clip_max):
    return (clip_min is not None and raw < clip_min) or (clip_max is not None and raw > clip_max)


# (1.5, None): the raw ratio of padding and of the empty row (1) lies below clip_min, and must still read 1
BOUNDS = [(0.5, 3.0), (None, 3.0), (0.5, None), (None, None), (1.5, None)]


@pytest.mark.parametrize("clip_min,clip_max", BOUNDS)
@pytest.mark.parametrize("mode", IMPORTANCE_SAMPLING_MODES)
def test_ratio_and_stats_by_hand(mode, clip_min, clip_max):
    trainer, sampler, mask = ratio_inputs()
    ratio, stats = importance_sampling_ratio(trainer, sampler, mask, mode, clip_min=clip_min, clip_max=clip_max)
    assert ratio.dtype == torch.float64 and not ratio.requires_grad
    if mode.startswith("sequence"):
        raws = [math.exp(sum(real_differences(i))) for i in range(3)]  # row 3 has no real token
        want = [[constrain(r, mode, clip_min, clip_max)] for r in raws] + [[1.0]]
        assert ratio.shape == (4, 1)
    else:
        raws = [math.exp(d) for i in range(3) for d in real_differences(i)]
        flat = iter(constrain(r, mode, clip_min, clip_max) for r in raws)
        want = [[next(flat) if d is not None else 1.0 for d in row] for row in D]  # 1 on padding
        assert ratio.shape == (4, 3)
    torch.testing.assert_close(ratio, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    counted = [constrain(r, mode, clip_min, clip_max) for r in raws]  # real tokens, or sequences with one
    assert stats["ratio_min"].item() == pytest.approx(min(counted), rel=1e-12, abs=0)
    assert stats["ratio_mean"].item() == pytest.approx(sum(counted) / len(counted), rel=1e-12, abs=0)
    assert stats["ratio_max"].item() == pytest.approx(max(counted), rel=1e-12, abs=0)
    assert stats["out_of_bounds_fraction"].item() == pytest.approx(
        sum(outside(r, clip_min, clip_max) for r in raws) / len(raws), rel=1e-12, abs=0)


def test_the_data_exercises_every_region():
    # the hand test above means something only if the rows hold ratios below, inside and above the bounds
    trainer, sampler, mask = ratio_inputs()
    for mode, expected in (("token_truncate", 3 / 7), ("sequence_truncate", 2 / 3)):
        _, stats = importance_sampling_ratio(trainer, sampler, mask, mode, clip_min=0.5, clip_max=3.0)
        assert stats["out_of_bounds_fraction"].item() == pytest.approx(expected)
    ratio, _ = importance_sampling_ratio(trainer, sampler, mask, "token_mask", clip_min=0.5, clip_max=3.0)
    assert ratio[0].tolist() == pytest.approx([0.0, math.exp(0.3), 0.0])
    assert ratio[2, 1].item() == 1.0  # the unscorable token: difference 0, no correction


@pytest.mark.parametrize("mode", IMPORTANCE_SAMPLING_MODES)
def test_empty_mask_gives_zero_stats(mode):
    trainer, sampler, _ = ratio_inputs()
    ratio, stats = importance_sampling_ratio(trainer, sampler, torch.zeros(4, 3, dtype=torch.bool), mode)
    assert torch.isfinite(ratio).all()
    assert {k: v.item() for k, v in stats.items()} == {
        "ratio_min": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0, "out_of_bounds_fraction": 0.0}


@pytest.mark.parametrize("dtype,expected", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                            (torch.float64, torch.float64)])
def test_ratio_dtype(dtype, expected):
    trainer, sampler, mask = ratio_inputs(dtype)
    ratio, stats = importance_sampling_ratio(trainer, sampler, mask, "token_truncate")
    assert ratio.dtype == expected and stats["ratio_mean"].dtype == expected
    assert sampling_mismatch(trainer, sampler, mask)["kl"].dtype == expected


def test_sampling_mismatch_by_hand():
    trainer, sampler, mask = ratio_inputs()
    stats = sampling_mismatch(trainer, sampler, mask)
    seen = [d for row in D for d in row if d is not None and not math.isnan(d)]  # the NaN token is left out
    assert stats["logp_difference_mean"].item() == pytest.approx(sum(abs(d) for d in seen) / len(seen), rel=1e-12)
    assert stats["logp_difference_max"].item() == pytest.approx(2.0, rel=1e-12)
    kl = sum(math.exp(d) - 1 - d for d in seen) / len(seen)
    assert stats["kl"].item() == pytest.approx(kl, rel=1e-12)
    empty = sampling_mismatch(trainer, sampler, torch.zeros(4, 3))
    assert all(v.item() == 0.0 for v in empty.values())


def test_mismatch_kl_estimates_kl_from_sampler_to_trainer():
    # Tokens drawn from the sampler q; the mean of exp(r) - 1 - r (r = log p - log q) converges to KL(q || p), which
    # differs here from KL(p || q) by far more than the Monte Carlo error.
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([0.7, 0.2, 0.09, 0.01], dtype=torch.float64)
    p = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    tokens = torch.multinomial(q, 200_000, replacement=True, generator=gen).view(400, 500)
    stats = sampling_mismatch(p.log()[tokens], q.log()[tokens], torch.ones(400, 500))
    forward, reverse = (q * (q / p).log()).sum().item(), (p * (p / q).log()).sum().item()
    assert abs(forward - reverse) > 0.25
    assert stats["kl"].item() == pytest.approx(forward, rel=0.03)


def test_shape_errors():
    trainer, sampler, mask = ratio_inputs()
    with pytest.raises(ValueError, match=r"must all be \[B, T\]"):
        importance_sampling_ratio(trainer, sampler[:, :2], mask, "token_mask")
    with pytest.raises(ValueError, match=r"must all be \[B, T\]"):
        sampling_mismatch(trainer[0], sampler[0], mask[0])


# ---------------------------------------------------------------------------------------------------------------
# Knobs.
@pytest.mark.parametrize("kwargs,message", [
    (dict(mode="sequence"), "vllm_importance_sampling_mode='sequence' is unknown; use one of 'token_truncate', "
                            "'token_mask', 'sequence_truncate', 'sequence_mask'"),
    (dict(clip_max=0.0), "vllm_importance_sampling_clip_max must be > 0"),
    (dict(clip_max=-1.0, clip_min=None), "vllm_importance_sampling_clip_max must be > 0"),
    (dict(clip_min=-0.1), "vllm_importance_sampling_clip_min must be a finite number >= 0"),
    (dict(clip_min=3.0), r"vllm_importance_sampling_clip_min \(3.0\) must be < vllm_importance_sampling_clip_max"),
    (dict(clip_min=4.0, clip_max=3.0), r"vllm_importance_sampling_clip_min \(4.0\) must be <"),
    (dict(clip_max="3"), "vllm_importance_sampling_clip_max must be a number or null"),
    (dict(correction="yes"), "vllm_importance_sampling_correction must be true or false"),
])
def test_knob_checks_name_the_knob(kwargs, message):
    knobs = dict(correction=True, mode="sequence_mask", clip_min=None, clip_max=3.0) | kwargs
    with pytest.raises(ValueError, match=message):
        check_importance_sampling_knobs(**knobs)
    if "correction" not in kwargs:  # checked also while the correction is off
        with pytest.raises(ValueError, match=message):
            check_importance_sampling_knobs(**(knobs | dict(correction=False)))
    if "correction" not in kwargs:  # and by the ratio itself
        trainer, sampler, mask = ratio_inputs()
        with pytest.raises(ValueError, match=message):
            importance_sampling_ratio(trainer, sampler, mask, knobs["mode"], knobs["clip_min"], knobs["clip_max"])


@pytest.mark.parametrize("mode", IMPORTANCE_SAMPLING_MODES)
@pytest.mark.parametrize("clip_min,clip_max", [(None, None), (0.0, 3.0), (0.5, 3.0), (None, INF), (1.5, None)])
def test_valid_knobs_pass(mode, clip_min, clip_max):
    check_importance_sampling_knobs(True, mode, clip_min, clip_max)


# ---------------------------------------------------------------------------------------------------------------
# grpo_loss with the ratio. Three completions of lengths 3, 2, 3; LOGP - OLD spans the clip region; padding holds
# finite values (TRL's tensors have them) so the TRL transcription below can mask by multiplication.
OLD = [[-1.0, -2.0, -0.5], [-0.7, -1.2, -0.9], [-0.3, -1.6, -2.2]]
LOGP = [[-0.9, -2.3, 0.0], [-0.5, -1.6, -0.4], [-0.45, -1.5, -1.9]]
REF = [[-1.2, -1.5, -0.9], [-0.4, -1.0, -2.0], [-0.6, -1.1, -2.5]]
ADV = [1.0, -0.5, 0.7]
MASK = [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
TOKEN_RHO = [[0.5, 1.7, 0.0], [2.0, 0.8, 1.0], [1.2, 0.0, 3.0]]  # 0 = a masked-out token; 1 on padding
SEQUENCE_RHO = [[0.7], [1.6], [0.0]]  # row 2 dropped by a sequence mask
RHOS = {"token": TOKEN_RHO, "token_truncated": [[0.5, 1.7, 2.5], [2.0, 0.8, 1.0], [1.2, 0.6, 3.0]],
        "sequence": SEQUENCE_RHO}
VESPO = dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)


def loss_inputs():
    f64 = dict(dtype=torch.float64)
    return (torch.tensor(LOGP, **f64, requires_grad=True), torch.tensor(OLD, **f64), torch.tensor(ADV, **f64),
            torch.tensor(MASK), torch.tensor(REF, **f64))


def trl_loss(loss_type, logp, old, adv, mask, ref, beta, rho, epsilon=0.2, epsilon_high=0.28):
    """TRL 1.16's GRPO per-token loss and reduction written out from its formulas (plain tensor algebra)."""
    m = mask.to(logp.dtype)
    a = adv.unsqueeze(1)
    log_r = logp - old
    r = log_r.exp()
    if loss_type == "cispo":
        per_token = -(r.clamp(max=epsilon_high).detach()) * a * logp
    elif loss_type == "vespo":
        with torch.no_grad():
            log_w = (log_r.clamp(-20, 20) * m).sum(1, keepdim=True)
            if rho is not None:  # TRL folds log(rho) into the sequence log-ratio (summed over T, rho = 1 on padding)
                log_w = log_w + rho.log().clamp(math.log(1e-8), 20).sum(1, keepdim=True)
            log_w = log_w.clamp(math.log(1e-8), 20)
            k = torch.where(a >= 0, VESPO["k_pos"], VESPO["k_neg"])
            lam = torch.where(a >= 0, VESPO["lambda_pos"], VESPO["lambda_neg"])
            phi = (lam + k * log_w - lam * log_w.exp()).exp()
        per_token = -phi * a * logp
    else:
        per_token = -torch.minimum(r * a, r.clamp(1 - epsilon, 1 + epsilon_high) * a)
    if rho is not None and loss_type != "vespo":
        per_token = per_token * rho
    per_token = per_token + beta * ((ref - logp).exp() - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per_token * m).sum(1) / m.sum(1)).mean()
    return (per_token * m).sum() / m.sum()


def ours(loss_type, rho=None, beta=0.1, **kw):
    logp, old, adv, mask, ref = loss_inputs()
    loss, _ = grpo_loss(logp, old, adv, mask, loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, beta=beta,
                        ref_per_token_logps=ref, importance_sampling_ratio=rho, use_bias_correction_kl=False, **kw)
    loss.backward()
    return loss, logp.grad


@pytest.mark.parametrize("level", list(RHOS))
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo", "vespo"])
def test_grpo_loss_matches_trl_transcription(loss_type, level):
    rho = torch.tensor(RHOS[level], dtype=torch.float64)
    loss, grad = ours(loss_type, rho)
    logp, old, adv, mask, ref = loss_inputs()
    want = trl_loss(loss_type, logp, old, adv, mask, ref, 0.1, rho)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad * mask, logp.grad * mask, rtol=1e-12, atol=1e-15)
    assert (grad[mask == 0] == 0).all()
    assert loss.item() != pytest.approx(ours(loss_type)[0].item(), rel=1e-6)  # the ratio changed something


@pytest.mark.parametrize("level", list(RHOS))
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_gradient_is_the_ratio_weighted_policy_gradient_plus_the_unweighted_kl(loss_type, level):
    rho = torch.tensor(RHOS[level], dtype=torch.float64)
    _, grad = ours(loss_type, rho, beta=0.1)
    _, policy_grad = ours(loss_type, beta=0.0)
    _, full_grad = ours(loss_type, beta=0.1)
    kl_grad = full_grad - policy_grad
    assert kl_grad.abs().max() > 1e-3
    torch.testing.assert_close(grad, rho * policy_grad + kl_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_without_a_ratio_the_loss_is_unchanged(loss_type):
    kw = dict(max_completion_length=3, importance_sampling_level="sequence" if loss_type == "luspo" else "token",
              off_policy_mask_threshold=0.1)
    logp, old, adv, mask, ref = loss_inputs()
    before, stats_before = grpo_loss(logp, old, adv, mask, loss_type=loss_type, epsilon_high=0.28, beta=0.1,
                                     ref_per_token_logps=ref, **kw)
    before.backward()
    grad_before = logp.grad
    for extra in (dict(importance_sampling_ratio=None, sampling_per_token_logps=None),
                  dict(importance_sampling_ratio=torch.ones(3, 3, dtype=torch.float64)),
                  dict(importance_sampling_ratio=torch.ones(3, 1, dtype=torch.float64))):
        logp, old, adv, mask, ref = loss_inputs()
        after, stats_after = grpo_loss(logp, old, adv, mask, loss_type=loss_type, epsilon_high=0.28, beta=0.1,
                                       ref_per_token_logps=ref, **kw, **extra)
        after.backward()
        assert torch.equal(after, before) and torch.equal(logp.grad, grad_before)
        assert stats_after.keys() == stats_before.keys()
        assert all(torch.equal(stats_after[k], stats_before[k]) for k in stats_before)


def test_ratio_values_under_padding_are_never_read():
    rho = torch.tensor(TOKEN_RHO, dtype=torch.float64)
    rho[1, 2] = NAN
    for loss_type in ("dapo", "vespo"):
        loss, grad = ours(loss_type, rho)
        clean_loss, clean_grad = ours(loss_type, torch.tensor(TOKEN_RHO, dtype=torch.float64))
        assert torch.equal(loss, clean_loss) and torch.equal(grad, clean_grad)


def test_ratio_shape_errors():
    for shape in [(3,), (3, 2), (2, 1), (3, 3, 1)]:
        with pytest.raises(ValueError, match=r"importance_sampling_ratio must be \[B, T\] = \[3, 3\]"):
            ours("dapo", torch.ones(shape, dtype=torch.float64))
    logp, old, adv, mask, _ = loss_inputs()
    with pytest.raises(ValueError, match=r"sampling_per_token_logps must be \[B, T\]"):
        grpo_loss(logp, old, adv, mask, off_policy_mask_threshold=0.1, sampling_per_token_logps=old[:, :2])


# ---------------------------------------------------------------------------------------------------------------
# The off-policy mask reads the sampler's log-probs when given. Rows 1 and 2 have A < 0. Mean (base - logp) per row:
#   with OLD:        row 1 = (-0.2 + 0.4) / 2 = 0.1,        row 2 = (0.15 - 0.1 - 0.3) / 3 < 0
#   with SAMPLING:   row 1 = (-0.2 + 0.0) / 2 = -0.1 (kept), row 2 = (0.85 + 0.5 - 0.3) / 3 = 0.35 (dropped)
# so at threshold 0.05 the old log-probs drop row 1 and the sampler's drop row 2 instead. Row 0 (A > 0) holds an
# unscorable token (NaN) and padding holds NaN too.
ADV_OPM = [1.0, -0.5, -0.7]
SAMPLING = [[-0.9, NAN, 0.5], [-0.7, -1.6, NAN], [0.4, -1.0, -2.2]]


def opm_loss(sampling=None, threshold=0.05, adv=ADV_OPM, sampling_rows=SAMPLING):
    logp, old, _, mask, _ = loss_inputs()
    s = None if sampling is None else torch.tensor(sampling_rows, dtype=torch.float64)
    loss, _ = grpo_loss(logp, old, torch.tensor(adv, dtype=torch.float64), mask, loss_type="dapo",
                        epsilon_high=0.28, off_policy_mask_threshold=threshold, sampling_per_token_logps=s)
    loss.backward()
    return loss, logp.grad


def kept_rows_loss(keep):
    logp, old, _, mask, _ = loss_inputs()
    adv = torch.tensor(ADV_OPM, dtype=torch.float64)
    per_token = trl_loss_tokens(logp, old, adv)
    loss = (per_token * mask * torch.tensor(keep, dtype=torch.float64)[:, None]).sum() / mask.sum()
    loss.backward()
    return loss, logp.grad


def trl_loss_tokens(logp, old, adv, epsilon=0.2, epsilon_high=0.28):
    r = (logp - old).exp()
    a = adv.unsqueeze(1)
    return -torch.minimum(r * a, r.clamp(1 - epsilon, 1 + epsilon_high) * a)


def test_off_policy_mask_reads_sampling_logps_when_given():
    with_old, grad_old = opm_loss()
    with_sampler, grad_sampler = opm_loss(sampling=True)
    want_old, want_grad_old = kept_rows_loss([1.0, 0.0, 1.0])
    want_sampler, want_grad_sampler = kept_rows_loss([1.0, 1.0, 0.0])
    assert with_old.item() == pytest.approx(want_old.item(), rel=1e-12)
    assert with_sampler.item() == pytest.approx(want_sampler.item(), rel=1e-12)
    torch.testing.assert_close(grad_old, want_grad_old, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad_sampler, want_grad_sampler, rtol=1e-12, atol=1e-15)
    assert (grad_old[1] == 0).all() and grad_old[2, 0] != 0  # row 1 token 1 is clipped (r = e^-0.4, A < 0)
    assert (grad_sampler[2] == 0).all() and grad_sampler[1, 0] != 0


def test_off_policy_mask_counts_an_unscorable_token_as_no_difference():
    # row 0 now has A < 0: its scorable tokens give mean (0.0 + 0.5) / 3 = 0.167 (the NaN counts 0, the mean is over
    # all three real tokens), kept at threshold 0.2, dropped at 0.15; with NaN propagating it would always be dropped
    adv = [-1.0, 0.5, 0.7]
    kept, _ = opm_loss(sampling=True, threshold=0.2, adv=adv)
    dropped, _ = opm_loss(sampling=True, threshold=0.15, adv=adv)
    logp, old, _, mask, _ = loss_inputs()
    per_token = trl_loss_tokens(logp, old, torch.tensor(adv, dtype=torch.float64))
    assert kept.item() == pytest.approx(((per_token * mask).sum() / mask.sum()).item(), rel=1e-12)
    assert dropped.item() == pytest.approx(((per_token * mask)[1:].sum() / mask.sum()).item(), rel=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# RLOO: one weight per sequence.
@pytest.mark.parametrize("shape", [(3,), (3, 1)])
def test_rloo_sequence_weight_by_hand(shape):
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -7.0], [-1.2, -0.3]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0], [-0.5, -3.0], [-1.0, -0.4]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    adv = torch.tensor([1.0, -1.0, -2.0])
    rho = [0.5, 2.0, 1.5]
    loss, stats = rloo_loss(logps, old, adv, mask, epsilon=0.2,
                            importance_sampling_ratio=torch.tensor(rho).reshape(shape))
    # sequence ratios: e^0.5 (A > 0: clipped to 1.2), e^0 = 1, e^-0.1 (A < 0, inside: unclipped)
    r2 = math.exp(-0.1)
    want = -(0.5 * 1.2 * 1.0 + 2.0 * 1.0 * -1.0 + 1.5 * r2 * -2.0) / 3
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / 3)  # the weight does not change the stats
    loss.backward()
    # d/dlogp_t of -rho r A / 3 = -rho r A / 3 on the unclipped rows' real tokens; the clipped row has none
    want_grad = [[0.0, 0.0], [-2.0 * 1.0 * -1.0 / 3, 0.0], [-1.5 * r2 * -2.0 / 3] * 2]
    torch.testing.assert_close(logps.grad, torch.tensor(want_grad), rtol=1e-6, atol=1e-7)


def test_rloo_without_a_weight_is_unchanged_and_shapes_are_checked():
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -7.0]])
    old = torch.tensor([[-1.5, -2.0], [-0.5, -3.0]])
    args = (logps, old, torch.tensor([1.0, -1.0]), torch.tensor([[1, 1], [1, 0]]))
    assert torch.equal(rloo_loss(*args)[0], rloo_loss(*args, importance_sampling_ratio=None)[0])
    assert torch.equal(rloo_loss(*args)[0], rloo_loss(*args, importance_sampling_ratio=torch.ones(2))[0])
    with pytest.raises(ValueError, match="one weight per sequence"):
        rloo_loss(*args, importance_sampling_ratio=torch.ones(2, 2))  # a token-level ratio


# ---------------------------------------------------------------------------------------------------------------
# PPO: the ratio weights each token's clipped term (verl's truncated importance sampling); sequence modes give one
# weight per completion, the same on each of its tokens. Per-token advantages; r = exp(LOGP - OLD) is inside the
# clip range on some tokens, outside it on others with the clipped branch the larger (no gradient there) or the
# unclipped one the larger (gradient -A r).
PPO_ADV = [[1.0, -0.5, 0.7], [-0.3, 0.8, 0.0], [0.4, -1.2, 0.9]]
PPO_RHOS = {"token": [[0.5, 1.7, 0.0], [2.0, 0.8, NAN], [1.2, 0.0, 3.0]],  # 0: a masked token; NaN on padding
            "sequence": [[0.7], [1.6], [0.0]]}  # row 2: a masked sequence


def ppo_by_hand(rho, num_tokens, cliprange=0.2):
    """The loss and its gradient in LOGP, on Python floats."""
    loss, grad = 0.0, [[0.0] * 3 for _ in range(3)]
    for i in range(3):
        for t in range(3):
            if not MASK[i][t]:
                continue
            a, r = PPO_ADV[i][t], math.exp(LOGP[i][t] - OLD[i][t])
            w = 1.0 if rho is None else rho[i][t if len(rho[i]) > 1 else 0]
            unclipped, clipped = -a * r, -a * min(max(r, 1 - cliprange), 1 + cliprange)
            loss += w * max(unclipped, clipped) / num_tokens
            if unclipped >= clipped:  # inside the range both branches are -A r, with gradient -A r
                grad[i][t] = w * -a * r / num_tokens
    return loss, grad


def ppo_ours(rho, num_tokens=None):
    logp, old, _, mask, _ = loss_inputs()
    ratio = None if rho is None else torch.tensor(rho, dtype=torch.float64)
    loss, stats = clipped_policy_loss(logp, old, torch.tensor(PPO_ADV, dtype=torch.float64), mask, 0.2, num_tokens,
                                      importance_sampling_ratio=ratio)
    loss.backward()
    return loss, logp.grad, stats


def test_ppo_data_exercises_both_clipped_branches():
    inside = [(i, t) for i in range(3) for t in range(3) if MASK[i][t] and 0.8 < math.exp(LOGP[i][t] - OLD[i][t]) < 1.2]
    assert inside == [(0, 0), (2, 0), (2, 1)]
    _, grad = ppo_by_hand(None, 8)
    no_gradient = [(i, t) for i in range(3) for t in range(3) if MASK[i][t] and grad[i][t] == 0]
    assert no_gradient == [(0, 1), (0, 2), (2, 2)]  # outside, the clipped branch the larger; (1, 0), (1, 1): not


@pytest.mark.parametrize("num_tokens", [None, 10.0])
@pytest.mark.parametrize("level", list(PPO_RHOS))
def test_ppo_policy_loss_with_a_ratio_by_hand(level, num_tokens):
    rho = PPO_RHOS[level]
    loss, grad, stats = ppo_ours(rho, num_tokens)
    want, want_grad = ppo_by_hand(rho, 8 if num_tokens is None else num_tokens)
    assert loss.item() == pytest.approx(want, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    masked = [(0, 2), (2, 1)] if level == "token" else [(2, 0), (2, 1), (2, 2)]
    assert all(grad[i, t] == 0 for i, t in masked)  # a masked token / sequence gets no gradient ...
    logp, old, _, mask, _ = loss_inputs()  # ... and its log-probs do not enter the loss at all
    moved = logp.detach().clone()
    for i, t in masked:
        moved[i, t] += 1.7
    again, _ = clipped_policy_loss(moved, old, torch.tensor(PPO_ADV, dtype=torch.float64), mask, 0.2, num_tokens,
                                   importance_sampling_ratio=torch.tensor(rho, dtype=torch.float64))
    assert again.item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-15)
    _, _, plain_stats = ppo_ours(None, num_tokens)  # the statistics are the policy's, not weighted
    assert all(torch.equal(stats[k], plain_stats[k]) for k in plain_stats)
    assert loss.item() != pytest.approx(ppo_ours(None, num_tokens)[0].item(), rel=1e-6)


def test_ppo_policy_loss_without_a_ratio_is_unchanged_and_shapes_are_checked():
    loss, grad, _ = ppo_ours(None)
    for ones in (torch.ones(3, 3), torch.ones(3, 1)):
        other, other_grad, _ = ppo_ours(ones.double().tolist())
        assert torch.equal(other, loss) and torch.equal(other_grad, grad)
    for shape in [(3,), (3, 2), (2, 1), (3, 3, 1)]:
        with pytest.raises(ValueError, match=r"importance_sampling_ratio must be \[B, T\] = \[3, 3\]"):
            ppo_ours(torch.ones(shape).tolist())
