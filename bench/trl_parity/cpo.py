"""TRL 1.16's CPO loss (CPO, SimPO, AlphaPO) on fixed logits, saved for tests/cpo/test_trl_parity.py to compare
with ours.

Regenerate by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    make .venv-bench/.installed      # if the bench venv is not there yet
    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/trl_parity/cpo.py   # writes tests/fixtures/trl_cpo_parity.pt

Nothing of lightalign is imported: the inputs are seeded tensors, the outputs are what TRL's own code returns.
``CPOTrainer.get_batch_loss_metrics`` (a method; called on a stand-in ``self`` carrying only what it reads: the
knobs as ``CPOConfig`` resolves them (its ``alphapo`` sets ``loss_type="simpo"`` and ``cpo_alpha=0``), TRL's own
``concatenated_forward``, ``concatenated_inputs``, ``get_batch_logps`` and ``cpo_loss``, an ``accelerator`` on
the CPU whose ``gather_for_metrics`` is the identity (one process), and a stand-in model returning the seeded
logits) forms the whole loss: the loss type's term on the per-sequence log-probs (sums, or per-token means for
``ipo``/``simpo``) plus ``cpo_alpha`` times the cross-entropy of the chosen completion tokens. Cases: every loss
type at TRL's defaults, ``label_smoothing`` 0.1 (sigmoid, simpo), ``cpo_alpha`` 0 (sigmoid, simpo), ``simpo_gamma``
1.0, ``alpha`` 0.25 (every loss type), ``beta`` 2.0 (simpo). Saved per case: the knobs, the loss, its gradient
with respect to the logits, and TRL's logged metrics.

The file is small (tensors in a dict, loadable with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import os
import tempfile
import types
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
import trl  # noqa: E402
from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "trl_cpo_parity.pt"
PAIRS, WIDTH, VOCAB = 4, 8, 10
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "nll_loss")
DEFAULTS = {"loss_type": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "cpo_alpha": 1.0, "simpo_gamma": 0.5,
            "alpha": 0.0}


def pair_inputs(prompt_lengths: list[int]) -> dict[str, torch.Tensor]:
    """Seeded logits ``[2B, T, V]`` (chosen rows first) and the rows' ids, attention masks and labels (-100 on the
    prompt and the padding), completions of different lengths."""
    g = torch.Generator().manual_seed(51)
    ends = torch.tensor([8, 5, 7, 4, 6, 8, 3, 7])  # each row's length (prompt + completion)
    prompts = torch.tensor(prompt_lengths * 2)
    ids = torch.randint(1, VOCAB, (2 * PAIRS, WIDTH), generator=g)
    position = torch.arange(WIDTH).unsqueeze(0)
    attention = (position < ends.unsqueeze(1)).long()
    ids = ids * attention
    labels = torch.where((position >= prompts.unsqueeze(1)) & attention.bool(), ids, -100)
    logits = torch.randn(2 * PAIRS, WIDTH, VOCAB, generator=g) * 2.0
    return {"logits": logits, "input_ids": ids, "attention_mask": attention, "labels": labels}


def trl_batch(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    batch = {}
    for side, rows in (("chosen", slice(0, PAIRS)), ("rejected", slice(PAIRS, 2 * PAIRS))):
        batch[f"{side}_input_ids"] = x["input_ids"][rows]
        batch[f"{side}_attention_mask"] = x["attention_mask"][rows]
        batch[f"{side}_labels"] = x["labels"][rows]
    return batch


def stand_in_model(logits: torch.Tensor):
    return lambda input_ids, attention_mask=None, use_cache=False, **kw: types.SimpleNamespace(logits=logits)


def accelerator():
    return types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda v: v)


def case(x: dict[str, torch.Tensor], **knobs) -> dict:
    given = {**DEFAULTS, **knobs}
    with tempfile.TemporaryDirectory() as tmp:
        config = CPOConfig(output_dir=tmp, report_to=[], use_cpu=True, bf16=False, **given)
    logits = x["logits"].clone().requires_grad_(True)
    stand_in = types.SimpleNamespace(
        beta=config.beta, label_smoothing=config.label_smoothing, loss_type=config.loss_type,
        cpo_alpha=config.cpo_alpha, simpo_gamma=config.simpo_gamma, alpha=config.alpha, is_encoder_decoder=False,
        pad_token_id=0, aux_loss_enabled=False, accelerator=accelerator(),
        concatenated_inputs=CPOTrainer.concatenated_inputs, get_batch_logps=CPOTrainer.get_batch_logps)
    stand_in.concatenated_forward = lambda model, batch: CPOTrainer.concatenated_forward(stand_in, model, batch)
    stand_in.cpo_loss = lambda c, r: CPOTrainer.cpo_loss(stand_in, c, r)
    loss, metrics = CPOTrainer.get_batch_loss_metrics(stand_in, stand_in_model(logits), trl_batch(x))
    loss.backward()
    return {**given, "loss": loss.detach(), "grad": logits.grad,
            "metrics": {k: torch.tensor(metrics[k]) for k in METRICS}}


CASES = (
    *({"loss_type": t} for t in ("sigmoid", "hinge", "ipo", "simpo", "alphapo")),
    {"loss_type": "sigmoid", "label_smoothing": 0.1}, {"loss_type": "simpo", "label_smoothing": 0.1},
    {"loss_type": "sigmoid", "cpo_alpha": 0.0}, {"loss_type": "simpo", "cpo_alpha": 0.0},
    {"loss_type": "simpo", "simpo_gamma": 1.0}, {"loss_type": "simpo", "beta": 2.0},
    *({"loss_type": t, "alpha": 0.25} for t in ("sigmoid", "hinge", "ipo", "simpo", "alphapo")),
)


def main() -> None:
    torch.manual_seed(0)
    x = pair_inputs([2, 3, 1, 2])
    cases = [case(x, **knobs) for knobs in CASES]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"trl_version": str(trl.__version__), "torch_version": str(torch.__version__), "inputs": x,
                "cases": cases}, OUT)
    print(f"TRL {trl.__version__}: {len(cases)} CPO cases -> {OUT}")
    for c in cases:
        knobs = {k: c[k] for k in DEFAULTS if c[k] != DEFAULTS[k]}
        print(f"  {knobs}: loss {c['loss'].item():.7f}, nll {c['metrics']['nll_loss'].item():.5f}")


if __name__ == "__main__":
    main()
