"""RLOO's pure functions against hand computations (TRL 1.16's formulas; see modules/losses/rloo.py)."""

import math

import pytest
import torch

from lightalign.modules.losses.advantages import kl_penalized_rewards, rloo_advantages
from lightalign.modules.losses.rloo import rloo_loss


def test_leave_one_out_baseline_by_hand():
    # group 1: baselines (2+4)/2=3, (1+4)/2=2.5, (1+2)/2=1.5; group 2: one unscorable completion (NaN) is left out of
    # its siblings' baselines and gets advantage 0
    rewards = torch.tensor([1.0, 2.0, 4.0, 0.0, 3.0, float("nan")])
    adv = rloo_advantages(rewards, num_generations=3)
    assert adv.tolist() == pytest.approx([-2.0, -0.5, 2.5, -3.0, 3.0, 0.0])


def test_single_scorable_completion_gets_zero():
    rewards = torch.tensor([5.0, float("nan"), 1.0, 2.0])
    assert rloo_advantages(rewards, num_generations=2).tolist() == pytest.approx([0.0, 0.0, -1.0, 1.0])


def test_normalize_over_the_batch_by_hand():
    rewards = torch.tensor([1.0, 2.0, 4.0, 0.0, 0.0, float("nan")])
    raw = [-2.0, -0.5, 2.5, 0.0, 0.0]  # the NaN row is left out of the mean and std
    mean = sum(raw) / 5
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / 4)  # Bessel-corrected, as TRL's nanstd
    expected = [(a - mean) / (std + 1e-4) for a in raw] + [0.0]
    assert rloo_advantages(rewards, 3, normalize=True).tolist() == pytest.approx(expected, rel=1e-6)
    # under DDP the mean and std are the whole batch's: another rank's advantages change them
    other_rank = torch.tensor([10.0, 0.0, 0.0])
    pooled = rloo_advantages(rewards, 3, normalize=True, gather=lambda local: torch.cat([local, other_rank]))
    pool = raw + [10.0, 0.0, 0.0]
    mean = sum(pool) / len(pool)
    std = math.sqrt(sum((a - mean) ** 2 for a in pool) / (len(pool) - 1))
    assert pooled[0].item() == pytest.approx((-2.0 - mean) / (std + 1e-4), rel=1e-6)


def test_kl_goes_into_the_reward_per_sequence():
    old = torch.tensor([[-1.0, -2.0, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    rewards, kl = kl_penalized_rewards(torch.tensor([2.0]), old, ref, mask, beta=0.1)
    assert kl.tolist() == pytest.approx([0.5 - 1.0])  # first-order log-ratio summed; the masked token is out
    assert rewards.tolist() == pytest.approx([2.0 - 0.1 * (-0.5)])


def test_clipped_sequence_loss_and_its_gradient_by_hand():
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -7.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0], [-0.5, -3.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = rloo_loss(logps, old, adv, mask, epsilon=0.2)
    # sequence ratios: exp(-3 - -3.5) = e^0.5 (clipped to 1.2, A > 0) and exp(-0.5 - -0.5) = 1
    assert loss.item() == pytest.approx(-(1.2 * 1.0 + 1.0 * -1.0) / 2)
    assert stats["clip_ratio/high_mean"].item() == 0.5 and stats["clip_ratio/low_mean"].item() == 0.0
    loss.backward()
    # the clipped sequence has no gradient; the other: d(-ratio*A/2)/dlogp_t = -A/2 = 0.5 on its unmasked token
    assert logps.grad.tolist() == [[0.0, 0.0], [0.5, 0.0]]


def test_on_policy_ratio_is_one_with_the_policy_gradient():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = rloo_loss(logps, None, torch.tensor([2.0]), torch.tensor([[1, 1]]), epsilon=0.2, epsilon_high=0.3)
    assert loss.item() == pytest.approx(-2.0)
    loss.backward()
    assert logps.grad.tolist() == [[-2.0, -2.0]]


def test_bad_groups_refused():
    with pytest.raises(ValueError, match="whole groups"):
        rloo_advantages(torch.zeros(5), num_generations=2)
