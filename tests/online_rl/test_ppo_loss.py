"""PPO's pure functions against numbers worked out by hand (in the comments) on tiny tensors."""

import math

import pytest
import torch

from lightalign.modules.losses.advantages import gae, token_rewards, whiten
from lightalign.modules.losses.ppo import (AdaptiveKLController, FixedKLController, ScoreProcessor, clipped_policy_loss,
                                         clipped_value_loss, explained_variance)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def test_gae_by_hand_with_a_mask():
    # gamma 0.9, lam 0.5 (gamma * lam = 0.45). Row 0 ends after 3 tokens: its 4th reward and value are padding.
    #   t=2: delta = 2 + 0.9*0 - 0.5 = 1.5                 A2 = 1.5
    #   t=1: delta = 0 + 0.9*0.5 - 1 = -0.55               A1 = -0.55 + 0.45*1.5 = 0.125
    #   t=0: delta = 1 + 0.9*1 - 0.5 = 1.4                 A0 = 1.4 + 0.45*0.125 = 1.45625
    # Row 1, all 4 tokens:
    #   t=3: delta = 1 - 4 = -3                            A3 = -3
    #   t=2: delta = 3 + 0.9*4 - 3 = 3.6                   A2 = 3.6 - 0.45*3 = 2.25
    #   t=1: delta = 0 + 0.9*3 - 2 = 0.7                   A1 = 0.7 + 0.45*2.25 = 1.7125
    #   t=0: delta = 0 + 0.9*2 - 1 = 0.8                   A0 = 0.8 + 0.45*1.7125 = 1.570625
    rewards = torch.tensor([[1.0, 0.0, 2.0, 5.0], [0.0, 0.0, 3.0, 1.0]])
    values = torch.tensor([[0.5, 1.0, 0.5, 9.0], [1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    close(advantages, [[1.45625, 0.125, 1.5, 0.0], [1.570625, 1.7125, 2.25, -3.0]])
    close(returns, [[1.95625, 1.125, 2.0, 0.0], [2.570625, 3.7125, 5.25, 1.0]])


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[0.5, -1.0, 2.0]])
    values = torch.tensor([[0.25, 0.5, 1.0]])
    advantages, returns = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(advantages, [[1.5 - 0.25, 1.0 - 0.5, 2.0 - 1.0]])
    close(returns, [[1.5, 1.0, 2.0]])


def test_whiten_masked_unbiased():
    # masked entries 0, 2, 4: mean 2, unbiased variance (4 + 0 + 4) / 2 = 4, std 2; the padding is transformed too
    x = torch.tensor([[0.0, 2.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    close(whiten(x, mask), [[-1.0, 0.0, 1.0, 49.0]], atol=1e-6)
    close(whiten(x, mask, shift_mean=False), [[1.0, 2.0, 3.0, 51.0]], atol=1e-6)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        whiten(x, torch.tensor([[1, 0, 0, 0]]))


def test_token_rewards_kl_on_every_token_score_on_the_last():
    # kl row 0: [-1+1.5, -2+2, -3+2] = [0.5, 0, -1]; row 1: [0.5, 0, (masked)]; rewards -0.1 * kl + score at the end
    scores = torch.tensor([2.0, -1.0])
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, -9.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, kl = token_rewards(scores, logps, ref, mask, kl_coef=0.1)
    close(kl, [[0.5, 0.0, -1.0], [0.5, 0.0, 0.0]])
    close(rewards, [[-0.05, 0.0, 2.1], [-0.05, -1.0, 0.0]])
    rewards, kl = token_rewards(scores, logps, None, mask, kl_coef=0.1)  # no reference: the score alone
    close(rewards, [[0.0, 0.0, 2.0], [0.0, -1.0, 0.0]])


def test_clipped_policy_loss_by_hand():
    # ratios 1.5, 0.5, 1.1 (and a masked 3.0), advantages 1, -2, 3, cliprange 0.2:
    #   tok 0: max(-1*1.5, -1*1.2) = -1.2 (clipped)   tok 1: max(2*0.5, 2*0.8) = 1.6 (clipped)   tok 2: -3.3 (inside)
    ratios = [1.5, 0.5, 1.1, 3.0]
    logps = torch.tensor([[math.log(r) for r in ratios]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -2.0, 3.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = clipped_policy_loss(logps, old, adv, mask, cliprange=0.2)
    close(loss, (-1.2 + 1.6 - 3.3) / 3)
    close(stats["clipfrac"], 2 / 3)
    close(stats["approxkl"], 0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2 + math.log(1.1) ** 2) / 3)
    loss6, _ = clipped_policy_loss(logps, old, adv, mask, cliprange=0.2, num_tokens=6)
    close(loss6, (-1.2 + 1.6 - 3.3) / 6)


def test_clipped_policy_loss_gradient_is_zero_where_clipped():
    logps = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)
    loss, _ = clipped_policy_loss(logps, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), 0.2)
    loss.backward()
    # token 0 is clipped (no gradient); token 1: d/dlogp of -r/2 = -1.1/2
    close(logps.grad, [[0.0, -0.55]])


def test_clipped_value_loss_by_hand():
    # cliprange_value 0.2:
    #   tok 0: V=1 clipped to 0.7 (old 0.5): max((1-2)^2, (0.7-2)^2) = 1.69 (clipped)
    #   tok 1: V=0 clipped to 0.3: max((0-1)^2, (0.3-1)^2) = 1      tok 2: V=2 inside: 4      tok 3 masked
    values = torch.tensor([[1.0, 0.0, 2.0, 9.0]])
    old = torch.tensor([[0.5, 0.5, 2.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = clipped_value_loss(values, old, returns, mask, cliprange_value=0.2)
    close(loss, 0.5 * (1.69 + 1.0 + 4.0) / 3)
    close(stats["clipfrac"], 1 / 3)
    loss4, _ = clipped_value_loss(values, old, returns, mask, cliprange_value=0.2, num_tokens=4)
    close(loss4, 0.5 * (1.69 + 1.0 + 4.0) / 4)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    close(explained_variance(returns.clone(), returns, mask), 1.0)
    close(explained_variance(torch.zeros(1, 4), returns, mask), 0.0)
    # residual [0.5, 0, -0.5] (var 1/6) against returns' var 2/3: 1 - 0.25
    close(explained_variance(torch.tensor([[0.5, 2.0, 3.5, 0.0]]), returns, mask), 0.75)


def test_kl_controllers():
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(9.0, 100)  # error 9/6 - 1 = 0.5, clipped to 0.2: x (1 + 0.2 * 100 / 10000) = 1.002
    close(ctl.value, 0.2004)
    ctl.update(3.0, 100)  # error -0.5 -> -0.2: x 0.998
    close(ctl.value, 0.2004 * 0.998)
    ctl2 = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl2.update(6.6, 1000)  # error 0.1 (inside the clip): x 1.01
    close(ctl2.value, 0.202)
    restored = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05


def test_score_processor_scaling_norm_clip_and_penalty():
    proc = ScoreProcessor(missing_eos_penalty=0.5)
    close(proc.penalize(torch.tensor([1.0, 1.0]), torch.tensor([True, False])), [1.0, 0.5])
    # [1, 2, 3, 4]: mean 2.5, unbiased variance 5/3
    std = math.sqrt(5 / 3)
    scale = ScoreProcessor(use_score_scaling=True)
    close(scale.scale(torch.tensor([1.0, 2.0, 3.0, 4.0])), [x / std for x in (1, 2, 3, 4)], atol=1e-5)
    # then [10]: all five scores 1, 2, 3, 4, 10 have mean 4 and unbiased variance (9+4+1+0+36)/4 = 12.5
    close(scale.scale(torch.tensor([10.0])), [10 / math.sqrt(12.5)], atol=1e-5)
    norm = ScoreProcessor(use_score_scaling=True, use_score_norm=True)
    norm.scale(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    close(norm.scale(torch.tensor([10.0])), [6 / math.sqrt(12.5)], atol=1e-5)
    restored = ScoreProcessor(use_score_scaling=True, use_score_norm=True)
    restored.load_state_dict(norm.state_dict())
    close(restored.scale(torch.tensor([4.0])), norm.scale(torch.tensor([4.0])))
    clip = ScoreProcessor(score_clip=1.0)
    close(clip.scale(torch.tensor([-3.0, 0.5, 2.0])), [-1.0, 0.5, 1.0])
