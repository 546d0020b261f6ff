"""A method built from the shared online-RL components (examples/custom_online_rl.py: REINFORCE with a group
baseline) trains through the loop with its own knob and objective: its advantages are the hand-computed ones from
the rewards the rollout recorded, and its loss's gradient reaches the policy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from custom_online_rl import ReinforceModule  # noqa: E402
from helpers.rewards import Recorder  # noqa: E402
from helpers.rollout_callbacks import KeepBuffer  # noqa: E402


def test_custom_method_trains_on_the_shared_loop(tiny_dir, prompt_data, quiet_trainer, grad_capture):
    keep, recorder, capture = KeepBuffer(), Recorder(), grad_capture()
    module = ReinforceModule(str(tiny_dir), from_config=True, reward_funcs=[recorder], num_generations=4,
                             max_completion_length=6, generation_batch_size=8, learning_rate=1e-2)
    quiet_trainer(max_steps=2, callbacks=[keep, capture]).fit(module, prompt_data())
    assert module.ref_model is None  # uses_reference False: no reference built
    rewards = recorder.rewards[0].view(-1, 4)
    expected = (rewards - rewards.mean(1, keepdim=True)).flatten()
    rows = torch.cat([mb["row"] for mb in keep.buffers[0]])
    got = torch.cat([mb["advantages"] for mb in keep.buffers[0]])[torch.argsort(rows)]
    torch.testing.assert_close(got.cpu(), expected, atol=1e-6, rtol=1e-6)
    assert expected.abs().sum() > 0  # rewards with variance inside the groups
    grads = capture.grads[0]
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "layers" in n)  # the loss reaches the policy
    assert module.generation_count == 2


def test_custom_knob_is_checked_and_sibling_knobs_refused(tiny_dir):
    from lightalign.rewards import digit_fraction_reward

    with pytest.raises(ValueError, match="baseline='mean' is unknown"):
        ReinforceModule(str(tiny_dir), from_config=True, reward_funcs=[digit_fraction_reward], baseline="mean")
    with pytest.raises(TypeError, match="ReinforceModule has no knob 'beta'"):
        ReinforceModule(str(tiny_dir), from_config=True, reward_funcs=[digit_fraction_reward], beta=0.1)
