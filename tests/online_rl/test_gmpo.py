"""GMPO (``loss_type: gmpo``, the registered policy loss ``gmpo_policy_loss``): equal to TRL 1.16's
``GMPOTrainer._compute_loss`` on identical tensors (tests/fixtures/trl_gmpo_parity.pt, written by
bench/trl_parity/gmpo.py in the bench venv), its knob checks, and two training steps of GRPOModule with it."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from lightalign.modules.losses.grpo import GRPOLossConfig, grpo_loss

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "trl_gmpo_parity.pt"


@functools.cache
def parity() -> dict:
    return torch.load(FIXTURE, weights_only=True)


def ours(x: dict, case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logps = x["per_token_logps"].clone().requires_grad_(True)
    # TRL's GMPOTrainer never weights its KL term by the ratio: use_bias_correction_kl=False is its KL
    config = GRPOLossConfig(loss_type="gmpo", epsilon=case["epsilon"], epsilon_high=case["epsilon_high"],
                            use_bias_correction_kl=False)
    loss, _ = grpo_loss(logps, None if case["on_policy"] else x["old_per_token_logps"], x["advantages"],
                        x["completion_mask"], config=config, beta=case["beta"],
                        ref_per_token_logps=x["ref_per_token_logps"] if case["beta"] else None,
                        entropy_mask=x["entropy_mask"] if case["entropy_mask"] else None)
    loss.backward()
    return loss.detach(), logps.grad


def case_ids():
    return [f"eps{c['epsilon']}-{c['epsilon_high']}-beta{c['beta']}-entropy{c['entropy_mask']}-"
            f"onpolicy{c['on_policy']}" for c in parity()["cases"]]


@pytest.mark.parametrize("index", range(len(parity()["cases"])), ids=case_ids())
def test_gmpo_equals_trl(index):
    """Loss and gradient within float32 rounding (relative 1e-6 of the largest value; ``exp``, sums of <= 7 terms)."""
    data = parity()
    case, x = data["cases"][index], data["inputs"]
    assert data["trl_version"] == "1.16.0"
    loss, grad = ours(x, case)
    assert loss.dtype == torch.float32
    assert (loss - case["loss"]).abs().item() <= 1e-6 * max(1.0, case["loss"].abs().item())
    assert (grad - case["grad"]).abs().max().item() <= 1e-6 * case["grad"].abs().max().item()
    assert case["grad"].abs().max() > 0


def test_a_completion_without_tokens_adds_nothing_where_trl_adds_minus_its_advantage():
    """TRL's geometric mean of an empty completion is exp(0 / 1) = 1, so its loss holds -A_i / B (with no gradient);
    here an empty completion contributes 0. Same gradient; the losses differ by exactly that term."""
    data = parity()
    x, case = data["inputs_with_empty_row"], data["empty_row_cases"][0]
    loss, grad = ours(x, case)
    empty = x["completion_mask"].sum(-1) == 0
    assert empty.sum() == 1
    trl_extra = (-x["advantages"][empty]).sum() / len(empty)
    assert (loss + trl_extra - case["loss"]).abs().item() <= 1e-6
    assert (grad - case["grad"]).abs().max().item() <= 1e-6 * case["grad"].abs().max().item()


@pytest.mark.parametrize("knobs, message", [
    (dict(importance_sampling_level="sequence"), "loss_type 'gmpo' builds its own sequence-level weight"),
    (dict(delta=4.0), "delta \\(two-sided clipping\\) applies"),
    (dict(epsilon=0.0), "epsilon"),
])
def test_gmpo_knob_errors(knobs, message):
    with pytest.raises(ValueError, match=message):
        GRPOLossConfig(loss_type="gmpo", **knobs)


def test_gmpo_trains_two_steps_in_grpo_module(quiet_trainer, grpo_module, prompt_data, monkeypatch):
    import lightalign.modules.grpo as grpo_mod

    calls = []

    def recording(*args, **kwargs):
        loss, stats = grpo_loss(*args, **kwargs)
        calls.append((kwargs["config"], loss.detach(), stats))
        return loss, stats

    monkeypatch.setattr(grpo_mod, "grpo_loss", recording)
    module = grpo_module(loss_type="gmpo", epsilon=0.4, generation_batch_size=8, num_iterations=2)
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(module, prompt_data())
    assert trainer.global_step == 2 and len(calls) == 2
    assert module.generation_count == 1  # the second step reuses the rollout with its old log-probs
    for config, loss, stats in calls:
        assert config.loss_type == "gmpo" and config.epsilon == 0.4
        assert torch.isfinite(loss) and "clip_ratio/region_mean" in stats
    assert all(torch.isfinite(p).all() for p in module.model.parameters())
