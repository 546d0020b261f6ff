"""TPO (``TPOModule`` with ``tpo_loss``): equal to TRL 1.16's ``TPOTrainer._compute_loss`` on identical logits and
batches (tests/fixtures/trl_tpo_parity.pt, written by bench/trl_parity/tpo.py in the bench venv): the loss, its
gradient with respect to the logits, and TRL's logged metrics; and our classic triple collator builds TRL's own
``DataCollatorForTriplePreference`` batch."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightalign import TPOModule
from lightalign.datamodules.triple_preference import TriplePreferenceCollator

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "trl_tpo_parity.pt"
METRICS = ("entropy", "num_tokens", "logits/chosen", "logits/rejected", "mean_token_accuracy", "rewards/chosen",
           "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


@functools.cache
def parity() -> dict:
    return torch.load(FIXTURE, weights_only=True)


@functools.cache
def tiny_model(tiny_dir: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_dir))


class Scripted(torch.nn.Module):
    """A policy whose forward returns the given logits (the fixture's), whatever the batch."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, **kwargs):
        return type("Out", (), {"logits": self.logits})()


def our_batch(rows: list[dict], include_reference: bool) -> dict[str, torch.Tensor]:
    ours = [{f"{k}_input_ids": r[f"{k}_ids"] for k in ("prompt", "chosen", "rejected", "reference")} for r in rows]
    return TriplePreferenceCollator(pad_token_id=0, include_reference=include_reference)(ours)


def ours(tiny_dir, case: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    data = parity()
    with_reference = case["tpo_alpha"] != 0.0
    logits = (data["logits"] if with_reference else data["pair_logits"]).clone().requires_grad_(True)
    module = TPOModule(model=tiny_model(str(tiny_dir)), loss_type=case["loss_type"], beta=case["beta"],
                       label_smoothing=case["label_smoothing"], tpo_alpha=case["tpo_alpha"],
                       tpo_l_gamma=case["tpo_l_gamma"])
    module.model = Scripted(logits)
    loss = module._step(our_batch(data["rows"], with_reference), module.train_stats)
    loss.backward()
    metrics = {k: module.train_stats[k.replace("/", "_")].compute().item() for k in METRICS if k != "num_tokens"}
    metrics["num_tokens"] = module.step_tokens.compute().item()
    return loss.detach(), logits.grad, metrics


def case_ids():
    return [f"{c['loss_type']}-beta{c['beta']}-ls{c['label_smoothing']}-alpha{c['tpo_alpha']}-gamma{c['tpo_l_gamma']}"
            for c in parity()["cases"]]


@pytest.mark.filterwarnings("ignore:label_smoothing")  # hinge/ipo ignore it, as TRL does (with a warning)
@pytest.mark.parametrize("index", range(len(parity()["cases"])), ids=case_ids())
def test_tpo_equals_trl(tiny_dir, index):
    """Loss, gradient and metrics within float32 rounding (relative 1e-6 of the largest value: log-softmax over 8
    logits, sums of <= 5 token log-probs). Mutations that fail it: flip the sign of ``delta`` in ``tpo_loss``;
    drop the NLL term (``tpo_alpha`` 1 cases); ``tpo-l`` (or ``ipo``) on summed instead of per-token log-probs
    (``length_normalized=False``); the NLL summed instead of averaged over the reference tokens."""
    data = parity()
    case = data["cases"][index]
    assert data["trl_version"] == "1.16.0"
    loss, grad, metrics = ours(tiny_dir, case)
    assert loss.dtype == torch.float32
    assert (loss - case["loss"]).abs().item() <= 1e-6 * max(1.0, case["loss"].abs().item()), (loss, case["loss"])
    assert (grad - case["grad"]).abs().max().item() <= 1e-6 * case["grad"].abs().max().item()
    assert case["grad"].abs().max() > 0
    for key in METRICS:
        assert metrics[key] == pytest.approx(case["metrics"][key], rel=1e-5, abs=1e-6), key


def test_our_classic_triple_batch_is_trls():
    """The padded layout (chosen rows, rejected rows, reference rows; right padding; completion mask) is TRL's
    collator's, with the reference rows and without them (``tpo_alpha`` 0). Mutation: put the reference block
    first -> fails."""
    data = parity()
    for include, theirs in ((True, data["batch"]), (False, data["pair_batch"])):
        batch = our_batch(data["rows"], include)
        for key in ("input_ids", "attention_mask", "completion_mask"):
            assert torch.equal(batch[key], theirs[key]), key
