"""The distillation losses (modules/losses/distill.py) against hand computations (plain ``math`` on Python floats)
and against TRL 1.16's own functions on identical tensors (tests/fixtures/trl_gkd_parity.pt, written by
bench/trl_parity/gkd.py in the bench venv)."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from lightalign.modules.losses.distill import (
    generalized_jsd_loss,
    on_policy_distillation_advantages,
    on_policy_distillation_loss,
)

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "trl_gkd_parity.pt"
B, T, V = 2, 5, 7
MASK = [[0, 1, 1, 1, 0],  # a prompt position first, padding last
        [1, 1, 0, 1, 1]]


def logits(seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(B, T, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def mask() -> torch.Tensor:
    return torch.tensor(MASK, dtype=torch.bool)


# ------------------------------------------------------------------------------------------------ hand computations
def softmax(row: list[float], temperature: float) -> list[float]:
    z = [x / temperature for x in row]
    top = max(z)
    e = [math.exp(x - top) for x in z]
    return [x / sum(e) for x in e]


def kl(a: list[float], b: list[float]) -> float:
    """KL(a || b) = sum_v a_v log(a_v / b_v)."""
    return sum(x * math.log(x / y) for x, y in zip(a, b))


def hand_jsd(student, teacher, mask_rows, beta: float, temperature: float) -> float:
    """GKD's divergence per kept token, mean over the kept tokens: beta 0 = KL(teacher || student), beta 1 =
    KL(student || teacher), else beta KL(teacher || m) + (1 - beta) KL(student || m), m = (1-beta) p + beta q."""
    total, count = 0.0, 0
    for b in range(len(mask_rows)):
        for t in range(len(mask_rows[b])):
            if not mask_rows[b][t]:
                continue
            p = softmax(student[b][t], temperature)
            q = softmax(teacher[b][t], temperature)
            if beta == 0:
                d = kl(q, p)
            elif beta == 1:
                d = kl(p, q)
            else:
                m = [(1 - beta) * x + beta * y for x, y in zip(p, q)]
                d = beta * kl(q, m) + (1 - beta) * kl(p, m)
            total += d
            count += 1
    return total / max(count, 1)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
def test_generalized_jsd_by_hand(beta, temperature):
    s, t = logits(0), logits(1, scale=3.0)
    got = generalized_jsd_loss(s, t, mask(), beta=beta, temperature=temperature)
    expected = hand_jsd(s.tolist(), t.tolist(), MASK, beta, temperature)
    assert got.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)


def test_beta_ends_are_the_two_kl_directions():
    # the two ends differ (KL is not symmetric): a swapped direction cannot pass both hand checks above by accident
    s, t = logits(0), logits(1, scale=3.0)
    forward = generalized_jsd_loss(s, t, mask(), beta=0.0).item()
    reverse = generalized_jsd_loss(s, t, mask(), beta=1.0).item()
    assert abs(forward - reverse) > 0.1
    # and swapping the models' roles swaps the ends
    assert generalized_jsd_loss(t, s, mask(), beta=1.0).item() == pytest.approx(forward, rel=1e-12)


# ------------------------------------------------------------------------------------------------ TRL 1.16 parity
@functools.cache
def parity() -> dict:
    return torch.load(FIXTURE, weights_only=True)


def gkd_ids():
    return [f"beta{c['beta']}-T{c['temperature']}-n{c['num_items_in_batch']}" for c in parity()["gkd"]]


@pytest.mark.parametrize("index", range(len(parity()["gkd"])), ids=gkd_ids())
def test_generalized_jsd_equals_trl(index):
    data = parity()
    case, x = data["gkd"][index], data["inputs"]
    assert data["trl_version"] == "1.16.0"
    student = x["student_logits"].clone().requires_grad_(True)
    loss = generalized_jsd_loss(student, x["teacher_logits"], x["labels"] != -100, beta=case["beta"],
                                temperature=case["temperature"], chunk_size=4,
                                num_items_in_batch=case["num_items_in_batch"])
    loss.backward()
    assert loss.dtype == torch.float32
    assert (loss.detach() - case["loss"]).abs().item() <= 1e-6
    assert (student.grad - case["grad"]).abs().max().item() <= 1e-6


def iw_opd_ids():
    return [f"gamma{c['gamma']}-T{c['temperature']}-rollout{c['with_rollout']}" for c in parity()["iw_opd"]]


@pytest.mark.parametrize("index", range(len(parity()["iw_opd"])), ids=iw_opd_ids())
def test_on_policy_distillation_equals_trl(index):
    data = parity()
    case, x = data["iw_opd"][index], data["inputs"]
    student = x["student_logits"].clone().requires_grad_(True)
    keep = x["labels"] != -100
    logps = torch.log_softmax(student / case["temperature"], -1).gather(-1, x["tokens"].unsqueeze(-1)).squeeze(-1)
    sampler = x["rollout_logprobs"] if case["with_rollout"] else logps.detach()
    advantages = on_policy_distillation_advantages(sampler, case["teacher_logprobs"], keep,
                                                   iw_opd_gamma=case["gamma"])
    loss = on_policy_distillation_loss(logps, advantages, keep)
    loss.backward()
    assert (loss.detach() - case["loss"]).abs().item() <= 1e-6
    assert (student.grad - case["grad"]).abs().max().item() <= 1e-6


# ------------------------------------------------------------------------------------------------ properties
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunk_size_does_not_change_the_loss_or_its_gradient(beta):
    # 7 kept tokens: chunks of 2, 3 and 5 do not divide them; 7 and 100 are one chunk
    s, t = logits(2), logits(3, scale=3.0)
    results = []
    for chunk in (1, 2, 3, 5, 7, 100):
        student = s.clone().requires_grad_(True)
        loss = generalized_jsd_loss(student, t, mask(), beta=beta, temperature=2.0, chunk_size=chunk)
        loss.backward()
        results.append((loss.item(), student.grad))
    for loss, grad in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-13)
        assert torch.allclose(grad, results[0][1], rtol=0, atol=1e-15)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_gradient_is_the_formula_s_gradient(beta, temperature):
    # the closed-form backward against autograd's numerical check, and against autograd through a dense formula
    s, t = logits(4), logits(5, scale=3.0)
    assert torch.autograd.gradcheck(
        lambda x: generalized_jsd_loss(x, t, mask(), beta=beta, temperature=temperature, chunk_size=3),
        (s.clone().requires_grad_(True),))
    dense = s.clone().requires_grad_(True)
    log_p, log_q = torch.log_softmax(dense / temperature, -1), torch.log_softmax(t / temperature, -1)
    if beta == 0.0:
        per_token = (log_q.exp() * (log_q - log_p)).sum(-1)
    elif beta == 1.0:
        per_token = (log_p.exp() * (log_p - log_q)).sum(-1)
    else:
        m = (1 - beta) * log_p.exp() + beta * log_q.exp()
        per_token = beta * (log_q.exp() * (log_q - m.log())).sum(-1) + (1 - beta) * (
            log_p.exp() * (log_p - m.log())).sum(-1)
    (per_token[mask()].sum() / mask().sum()).backward()
    ours = s.clone().requires_grad_(True)
    generalized_jsd_loss(ours, t, mask(), beta=beta, temperature=temperature).backward()
    assert torch.allclose(ours.grad, dense.grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gradient_reaches_the_student_only(beta):
    student = logits(6).requires_grad_(True)
    teacher = logits(7).requires_grad_(True)
    loss = generalized_jsd_loss(student, teacher, mask(), beta=beta)
    loss.backward()
    assert teacher.grad is None
    kept = student.grad.abs().sum(-1)
    assert (kept[mask()] > 0).all()
    assert (kept[~mask()] == 0).all()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_masked_positions_contribute_nothing(beta):
    s, t = logits(8), logits(9)
    student = s.clone().requires_grad_(True)
    loss = generalized_jsd_loss(student, t, mask(), beta=beta, temperature=2.0)
    loss.backward()
    noise = torch.randn(B, T, V, generator=torch.Generator().manual_seed(10), dtype=torch.float64) * 50
    changed_s, changed_t = s.clone(), t.clone()
    changed_s[~mask()] += noise[~mask()]
    changed_t[~mask()] -= noise[~mask()]
    changed = changed_s.requires_grad_(True)
    loss2 = generalized_jsd_loss(changed, changed_t, mask(), beta=beta, temperature=2.0)
    loss2.backward()
    assert loss2.item() == loss.item()
    assert torch.equal(changed.grad, student.grad)


def test_reads_logits_views_in_place_and_keeps_no_vocabulary_sized_intermediates():
    # TRL's layout (logits[:, :-1] against labels[:, 1:]) is a non-contiguous view; autograd must save only the inputs
    # themselves (and the kept-token indices), never a [tokens, V] intermediate of the divergence
    full = logits(11).requires_grad_(True)
    teacher_full = logits(12)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        loss = generalized_jsd_loss(full[:, :-1], teacher_full[:, :-1], mask()[:, 1:], beta=0.5, chunk_size=2)
    inputs = {full.untyped_storage().data_ptr(), teacher_full.untyped_storage().data_ptr()}
    for x in saved:
        assert x.untyped_storage().data_ptr() in inputs or (x.dim() == 1 and not x.is_floating_point()), \
            f"autograd keeps a tensor {tuple(x.shape)} {x.dtype} besides the inputs"
    loss.backward()
    dense = logits(11).requires_grad_(True)
    generalized_jsd_loss(dense[:, :-1].contiguous(), teacher_full[:, :-1].contiguous(), mask()[:, 1:],
                         beta=0.5).backward()
    assert torch.allclose(full.grad, dense.grad, rtol=0, atol=1e-15)


def test_no_kept_token_gives_zero_with_a_gradient_path():
    student = logits(13).requires_grad_(True)
    loss = generalized_jsd_loss(student, logits(14), torch.zeros(B, T, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(student.grad, torch.zeros_like(student))


def test_low_precision_student_gets_its_own_dtype_gradient():
    s = logits(15).to(torch.bfloat16)
    t = logits(16).to(torch.bfloat16)
    student = s.clone().requires_grad_(True)
    loss = generalized_jsd_loss(student, t, mask(), beta=0.5)
    loss.backward()
    assert loss.dtype == torch.float32 and student.grad.dtype == torch.bfloat16
    reference = generalized_jsd_loss(s.double(), t.double(), mask(), beta=0.5)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)


def test_a_teacher_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocabulary"):
        generalized_jsd_loss(logits(0), logits(1)[..., :6], mask())



def test_the_loss_knobs_are_refused_when_the_method_is_built(tiny_dir):
    """The temperature is the sampling knob (``SamplingKnobs``), checked once, at construction; the loss takes it
    as given."""
    from lightalign import DistillModule

    with pytest.raises(ValueError, match="temperature must be > 0"):
        DistillModule(str(tiny_dir), from_config=True, teacher_model_name_or_path=str(tiny_dir), temperature=0.0)
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\]"):  # DistillLossKnobs, not every loss call
        DistillModule(str(tiny_dir), from_config=True, teacher_model_name_or_path=str(tiny_dir), beta=1.5)


# ------------------------------------------------------------------------------------------------ on-policy
STUDENT_LOGPS = [[-9.0, -1.2, -0.7, -2.5, float("nan")],  # masked positions may hold anything
                 [-0.3, -1.9, float("-inf"), -1.1, -0.6]]
TEACHER_LOGPS = [[float("-inf"), -0.4, -1.5, -0.9, -3.0],
                 [-0.2, -2.6, -4.0, -0.8, -2.0]]
SAMPLER_LOGPS = [[-1.0, -1.0, -0.5, -2.0, -1.0],
                 [-0.4, -2.0, -1.0, -1.0, -0.5]]


def hand_advantages(sampler, teacher, gamma: float) -> list[list[float]]:
    out = []
    for b in range(B):
        a = [teacher[b][t] - sampler[b][t] if MASK[b][t] else 0.0 for t in range(T)]
        total = max(sum(abs(x) for x in a), 1e-8)
        before = 0.0
        row = []
        for x in a:
            row.append(x * (1 + gamma * (1 - before / total)))
            before += abs(x)
        out.append(row)
    return out


@pytest.mark.parametrize("gamma", [0.0, 0.5])
def test_on_policy_advantages_by_hand(gamma):
    got = on_policy_distillation_advantages(torch.tensor(SAMPLER_LOGPS, dtype=torch.float64),
                                            torch.tensor(TEACHER_LOGPS, dtype=torch.float64), mask(),
                                            iw_opd_gamma=gamma)
    expected = hand_advantages(SAMPLER_LOGPS, TEACHER_LOGPS, gamma)
    assert got.tolist() == [pytest.approx(row, rel=1e-12, abs=0) for row in expected]
    assert not got.requires_grad


@pytest.mark.parametrize("gamma", [0.0, 0.5])
def test_on_policy_loss_by_hand(gamma):
    logps = torch.tensor(STUDENT_LOGPS, dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor(TEACHER_LOGPS, dtype=torch.float64)
    # the sampler's log-probs may be the student's own, graph attached (TRL's default): the advantage stays constant
    advantages = on_policy_distillation_advantages(logps, teacher, mask(), iw_opd_gamma=gamma)
    loss = on_policy_distillation_loss(logps, advantages, mask())
    loss.backward()
    a = hand_advantages(STUDENT_LOGPS, TEACHER_LOGPS, gamma)
    kept = [(b, t) for b in range(B) for t in range(T) if MASK[b][t]]
    expected = -sum(a[b][t] * STUDENT_LOGPS[b][t] for b, t in kept) / len(kept)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # the advantage is a constant: d loss / d logp_t = -A_t / n, 0 (not NaN) where masked
    expected_grad = [[-a[b][t] / len(kept) if MASK[b][t] else 0.0 for t in range(T)] for b in range(B)]
    assert logps.grad.tolist() == [pytest.approx(row, rel=1e-12, abs=0) for row in expected_grad]
    # the plain method's advantage is the teacher's minus the student's log-prob (sign: the teacher's preference)
    if gamma == 0.0:
        assert advantages[0, 1].item() == pytest.approx(-0.4 - -1.2)


def test_on_policy_loss_divides_by_num_items_in_batch_when_given():
    logps = torch.tensor(SAMPLER_LOGPS, dtype=torch.float64)
    advantages = on_policy_distillation_advantages(logps, torch.tensor(TEACHER_LOGPS, dtype=torch.float64), mask())
    mean = on_policy_distillation_loss(logps, advantages, mask())
    assert on_policy_distillation_loss(logps, advantages, mask(), num_items_in_batch=16).item() == pytest.approx(
        mean.item() * int(mask().sum()) / 16, rel=1e-12)


def test_on_policy_refuses_a_missing_teacher_log_prob():
    teacher = torch.tensor(TEACHER_LOGPS, dtype=torch.float64)
    teacher[0, 2] = float("nan")
    with pytest.raises(ValueError, match="1 of 7 are missing"):
        on_policy_distillation_advantages(torch.tensor(SAMPLER_LOGPS, dtype=torch.float64), teacher, mask())
