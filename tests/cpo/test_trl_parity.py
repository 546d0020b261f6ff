"""CPO (every loss type: CPO, SimPO, AlphaPO) and ORPO against TRL 1.16's own ``get_batch_loss_metrics`` on identical
logits (tests/fixtures/trl_cpo_parity.pt and trl_orpo_parity.pt, written by bench/trl_parity/cpo.py and orpo.py in
the bench venv): the whole loss (preference term and NLL term), its gradient with respect to the logits, and the
logged statistics.

ORPO's inputs have prompts of 3, 4, 2 and 1 tokens, and ours runs the classic layout's real forward helper
(``completion_and_prompt_logps``, on a stand-in model returning the seeded logits): TRL's NLL is one token mean over
the whole chosen rows, prompt tokens included.

Mutations run, each failing these tests: ORPO's NLL over the chosen completions only again (the prompt log-probs
and counts left out of ``orpo_loss``'s ``nll``); ORPO's NLL as a mean of per-sequence means; a flipped sign of
the reward difference in ``cpo_loss``; the NLL term dropped from ``cpo_loss`` (and from ``orpo_loss``); SimPO
without length normalisation (``simpo`` registered with ``length_normalized=False``); ``alphapo`` keeping the NLL
term; ORPO's odds ratio with ``log1mexp`` replaced by 0 (a log-prob ratio instead of an odds ratio)."""

from __future__ import annotations

import functools
import types
from pathlib import Path

import pytest
import torch

from lightalign.modules.losses.cpo import CPOLossConfig, cpo_loss
from lightalign.modules.losses.implicit_reward import reward_stats
from lightalign.modules.losses.orpo import ORPOLossKnobs, orpo_loss
from lightalign.modules.training.logprobs import completion_logps
from lightalign.modules.training.preference_forward import completion_and_prompt_logps

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CPO_KNOBS = ("loss_type", "label_smoothing", "cpo_alpha", "simpo_gamma", "alpha")


@functools.cache
def parity(name: str) -> dict:
    data = torch.load(FIXTURES / f"trl_{name}_parity.pt", weights_only=True)
    assert data["trl_version"] == "1.16.0"
    return data


def pair_logps(x: dict) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The seeded logits as a leaf, and the summed completion log-probs and lengths (chosen, rejected) that the
    classic layout's forward gives (``completion_logps`` on the rows' ids and completion masks)."""
    logits = x["logits"].clone().requires_grad_(True)
    labels = x["labels"]
    ids = torch.where(labels == -100, x["input_ids"], labels)
    token_logps, mask = completion_logps(logits, ids, labels != -100)
    sums, lengths = token_logps.sum(-1), mask.sum(-1)
    half = sums.shape[0] // 2
    return logits, (sums[:half], sums[half:], lengths[:half], lengths[half:])


def assert_matches(loss, grad, stats, case, tolerance):
    """Loss, gradient and statistics within float32 rounding of sums over <= 8 tokens and a 10-way softmax
    (relative ``tolerance`` of the largest value)."""
    assert loss.dtype == torch.float32
    assert (loss.detach() - case["loss"]).abs().item() <= tolerance * max(1.0, case["loss"].abs().item())
    scale = case["grad"].abs().max().item()
    assert scale > 0 and (grad - case["grad"]).abs().max().item() <= tolerance * scale
    for name, value in case["metrics"].items():
        if name == "nll_loss" and value.item() == 0.0:  # TRL logs 0 when cpo_alpha = 0; ours logs the NLL
            continue
        assert abs(stats[name].item() - value.item()) <= tolerance * max(1.0, abs(value.item())), name


def cpo_case_ids():
    return ["-".join(f"{k}{c[k]}" for k in (*CPO_KNOBS, "beta")) for c in parity("cpo")["cases"]]


@pytest.mark.parametrize("index", range(len(parity("cpo")["cases"])), ids=cpo_case_ids())
def test_cpo_equals_trl(index):
    data = parity("cpo")
    case = data["cases"][index]
    logits, pairs = pair_logps(data["inputs"])
    config = CPOLossConfig(**{k: case[k] for k in CPO_KNOBS})
    loss, chosen_rewards, rejected_rewards, stats = cpo_loss(*pairs, config=config, beta=case["beta"])
    loss.backward()
    assert_matches(loss, logits.grad, {**stats, **reward_stats(chosen_rewards, rejected_rewards)}, case, 2e-6)


@pytest.mark.parametrize("index", range(len(parity("orpo")["cases"])),
                         ids=[f"beta{c['beta']}" for c in parity("orpo")["cases"]])
def test_orpo_equals_trl(index):
    data = parity("orpo")
    case, x = data["cases"][index], data["inputs"]
    assert (x["labels"][:4] == -100).logical_and(x["attention_mask"][:4].bool()).sum(-1).tolist() == [3, 4, 2, 1]
    logits = x["logits"].clone().requires_grad_(True)
    stand_in = lambda input_ids, attention_mask, use_cache: types.SimpleNamespace(logits=logits)  # noqa: E731
    batch = {"input_ids": x["input_ids"], "attention_mask": x["attention_mask"], "completion_mask": x["labels"] != -100}
    token_logps, mask, prompt_logps, prompt_lengths = completion_and_prompt_logps(stand_in, batch)
    assert prompt_lengths.tolist() == [2, 3, 1, 0]  # every prompt token but the row's first
    sums, lengths = token_logps.sum(-1), mask.sum(-1)
    loss, chosen_rewards, rejected_rewards, stats = orpo_loss(
        sums[:4], sums[4:], lengths[:4], lengths[4:], prompt_logps, prompt_lengths,
        config=ORPOLossKnobs(beta=case["beta"]))
    loss.backward()
    assert_matches(loss, logits.grad, {**stats, **reward_stats(chosen_rewards, rejected_rewards)}, case, 2e-6)
