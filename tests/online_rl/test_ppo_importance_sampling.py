"""PPO on rollouts sampled by vLLM (``use_vllm``, a fake engine at the ``generate`` boundary: tests/helpers/fake_vllm.py):
the rollout keeps the sampler's log-probs, the importance-sampling ratio of the rollout-time ``old_logps`` over them
(``vllm_importance_sampling_*``) weights the clipped policy term and nothing else, the ``sampling/*`` statistics are
logged, ``vllm_importance_sampling_correction: false`` trains exactly as the uncorrected PPO, and the knobs are
checked naming the knob. The loss itself against a hand computation: tests/online_rl/test_importance_sampling.py."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers.fake_vllm import offset, vllm_module
from helpers.rewards import varied_reward
from lightalign.modules import ppo as ppo_module
from lightalign.modules.sampling.vllm_engines import VLLMRollouts
from lightalign.modules.losses.importance_sampling import importance_sampling_ratio
from lightalign.modules.ppo import PPOModule

POLICY_LOSS = ppo_module.clipped_policy_loss
KNOBS = dict(reward_funcs=[varied_reward], max_completion_length=6, generation_batch_size=8, kl_coef=0.0,
             temperature=0.9)
# token ratios exp(-offset) in [0.78, 1.17]: clip_max 1.1 truncates the tokens at offset -0.15 (ratio 1.16)
CORRECTION = dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.1)


def record(module):
    """Every micro-batch the correction saw (with the training forward's log-probs and the ratio it gave), and a
    ``clipped_policy_loss`` that keeps the ratio each policy loss is given."""
    seen, ratio_of = [], module.off_policy.importance_ratio

    def recording(mod, mb, logps):
        ratio = ratio_of(mod, mb, logps)
        seen.append({**{k: v.detach().clone() for k, v in mb.items() if isinstance(v, torch.Tensor)},
                     "logps": logps.detach().clone(), "is_ratio": ratio})
        return ratio

    module.off_policy.importance_ratio = recording
    losses = []

    def spying(*args, **kwargs):
        losses.append(kwargs.get("importance_sampling_ratio"))
        return POLICY_LOSS(*args, **kwargs)

    return seen, losses, spying


def fit(tiny_dir, prompt_data, monkeypatch, grad_capture, use_vllm=True, steps=1, lr=0.0, **knobs):
    """One seeded PPO fit on the fake engine; the gradients of every optimizer step, the engine(s), the module and
    what ``record`` saw."""
    L.seed_everything(0)
    engines = []
    args = (str(tiny_dir),)
    knobs = dict(KNOBS, from_config=True, optimizer=lambda p: torch.optim.SGD(p, lr=lr), **knobs)
    if use_vllm:
        module = vllm_module(PPOModule, monkeypatch, engines, *args, **knobs)
        callbacks = []
    else:  # the same engine samples, but the module is not told: today's PPO on vLLM rollouts, uncorrected
        from helpers.fake_vllm import ShiftedPolicyEngine

        module = PPOModule(*args, **knobs)
        callbacks = [VLLMRollouts(engine_factory=lambda m, t, *_: engines.append(ShiftedPolicyEngine(m)) or engines[-1])]
    seen, losses, spying = record(module)
    monkeypatch.setattr(ppo_module, "clipped_policy_loss", spying)
    capture = grad_capture()
    trainer = L.Trainer(accelerator="cpu", logger=False, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, max_steps=steps,
                        callbacks=[capture, *callbacks])
    trainer.fit(module, prompt_data())
    return {"grads": capture.grads, "engines": engines, "module": module, "seen": seen, "losses": losses,
            "metrics": dict(trainer.callback_metrics)}


def engine_logps(engine, rollout: int, width: int) -> torch.Tensor:
    """The engine's answer to rollout ``rollout`` as ``[rows, width]``, rows in the rollout's order, 0 after each end."""
    rows = engine.answers[rollout]
    out = torch.zeros(len(rows), width)
    for i, values in enumerate(rows):
        out[i, :len(values)] = torch.tensor(values)
    return out


def test_the_ratio_is_old_logps_over_the_samplers_logps_and_reaches_the_policy_loss(
        tiny_dir, prompt_data, monkeypatch, grad_capture):
    # two passes over one rollout with a moving policy: the second pass's forward differs from old_logps
    run = fit(tiny_dir, prompt_data, monkeypatch, grad_capture, steps=2, lr=0.5, num_ppo_epochs=2, **CORRECTION)
    engine, seen = run["engines"][0], run["seen"]
    assert len(engine.answers) == 1 and len(seen) == 2 and engine.pushes >= 2
    for mb, given in zip(seen, run["losses"]):
        mask = mb["completion_mask"]
        sampler = engine_logps(engine, 0, mask.shape[1])[mb["row"]]
        torch.testing.assert_close(mb["sampling_logps"] * mask, sampler * mask, rtol=0, atol=0)
        expected, _ = importance_sampling_ratio(mb["old_logps"], sampler, mask, "token_truncate", None, 1.1)
        torch.testing.assert_close(mb["is_ratio"], expected, rtol=1e-6, atol=1e-7)
        assert given is mb["is_ratio"]  # the policy loss is weighted by exactly this ratio
        # the sampler is off by -offset(t): some tokens truncated at 1.1, none left at 1
        shifts = torch.tensor([offset(t) for t in range(mask.shape[1])])
        torch.testing.assert_close(expected[mask.bool()], (-shifts).exp().clamp(max=1.1).expand_as(mask)[mask.bool()],
                                   rtol=0, atol=2e-4)
        assert ((expected - 1).abs() > 0.04)[mask.bool()].all()
    # the second pass's forward has moved away from the rollout-time old_logps: the policy's side above is old_logps
    second = seen[1]["completion_mask"].bool()
    assert (seen[1]["logps"] - seen[1]["old_logps"])[second].abs().max() > 1e-3
    m = run["metrics"]
    for name in ("sampling_logp_difference/mean", "sampling_logp_difference/max", "kl",
                 "importance_sampling_ratio/min", "importance_sampling_ratio/mean", "importance_sampling_ratio/max",
                 "importance_sampling_ratio/out_of_bounds"):
        assert f"train/sampling/{name}" in m, name
    assert float(m["train/sampling/importance_sampling_ratio/max"]) == pytest.approx(1.1)
    assert float(m["train/sampling/sampling_logp_difference/max"]) == pytest.approx(0.25, abs=2e-4)
    assert "train/sampling/staleness" not in m  # PPO does not sample ahead


def test_the_ratio_changes_the_policy_gradient_and_never_the_value_loss(tiny_dir, prompt_data, monkeypatch,
                                                                        grad_capture):
    corrected = fit(tiny_dir, prompt_data, monkeypatch, grad_capture, **CORRECTION)
    plain = fit(tiny_dir, prompt_data, monkeypatch, grad_capture, vllm_importance_sampling_correction=False,
                **CORRECTION)
    assert corrected["losses"][0] is not None and plain["losses"][0] is None
    on, off = corrected["grads"][0], plain["grads"][0]
    assert on.keys() == off.keys()
    # the same rollout, advantages and returns: only the weighting differs
    for key in ("completion_ids", "old_logps", "old_values", "advantages", "returns"):
        assert torch.equal(corrected["seen"][0][key], plain["seen"][0][key]), key
    assert max((on[k] - off[k]).abs().max() for k in on if k.startswith("model.")) > 1e-4
    for name in ("value_head.summary.weight", "value_head.summary.bias"):  # the value loss alone reaches them
        assert off[name].abs().max() > 0
        assert torch.equal(on[name], off[name]), name


def test_correction_off_trains_exactly_as_uncorrected_ppo(tiny_dir, prompt_data, monkeypatch, grad_capture):
    off = fit(tiny_dir, prompt_data, monkeypatch, grad_capture, vllm_importance_sampling_correction=False)
    today = fit(tiny_dir, prompt_data, monkeypatch, grad_capture, use_vllm=False)
    assert off["losses"] == [None] and today["losses"] == [None]
    assert "sampling_logps" in off["seen"][0] and "sampling_logps" not in today["seen"][0]
    assert "train/sampling/kl" in off["metrics"]  # the mismatch is logged either way
    assert "train/sampling/importance_sampling_ratio/mean" not in off["metrics"]
    a, b = off["grads"][0], today["grads"][0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("knobs, error, message", [
    (dict(vllm_importance_sampling_mode="token"), ValueError, "vllm_importance_sampling_mode='token' is unknown"),
    (dict(vllm_importance_sampling_clip_max=0.0), ValueError, "vllm_importance_sampling_clip_max must be > 0"),
    (dict(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.5), ValueError,
     r"vllm_importance_sampling_clip_min \(2.0\) must be < vllm_importance_sampling_clip_max"),
    (dict(vllm_importance_sampling_correction="yes"), ValueError,
     "vllm_importance_sampling_correction must be true or false"),
    (dict(vllm_importance_sampling_cap=2.0), TypeError, "former name of vllm_importance_sampling_clip_max"),
    (dict(max_staleness=1), TypeError, "PPOModule has no knob 'max_staleness'; GRPOModule and RLOOModule take it"),
])
def test_ppo_knobs_are_checked_naming_the_knob(tiny_dir, knobs, error, message):
    with pytest.raises(error, match=message):
        PPOModule(str(tiny_dir), from_config=True, reward_funcs=[varied_reward], **knobs)
