"""TRL 1.16's ORPO loss on fixed logits, saved for tests/cpo/test_trl_parity.py to compare with ours.

Regenerate by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/trl_parity/orpo.py   # writes tests/fixtures/trl_orpo_parity.pt

Nothing of lightalign is imported; the seeded rows and logits are bench/trl_parity/cpo.py's (``pair_inputs``), with
prompts of 3, 4, 2 and 1 tokens (a pair's two rows share the prompt's length). ``ORPOTrainer.get_batch_loss_metrics`` (called on a stand-in ``self`` carrying only what it
reads: ``beta``, TRL's own ``concatenated_forward``, ``concatenated_inputs``, ``get_batch_logps`` and
``odds_ratio_loss``, a CPU ``accelerator`` whose ``gather_for_metrics`` is the identity, and a stand-in model
returning the seeded logits) forms the whole loss: the cross-entropy of the chosen rows minus ``beta`` times the
mean log-sigmoid of the log odds ratio of the completions' per-token mean log-probs. TRL's cross-entropy is one
token mean over every non-padding token of the batch's chosen rows after each row's first, prompt tokens included,
so the multi-token prompts here tell it apart from a completion-only NLL. Cases: ``beta`` 0.1 (TRL's default),
0 (plain NLL), 0.5 and 2.0. Saved per case: ``beta``, the loss, its gradient with respect to the logits, and TRL's
logged metrics.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import trl  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402

from cpo import METRICS, accelerator, pair_inputs, stand_in_model, trl_batch  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "trl_orpo_parity.pt"
ORPO_METRICS = (*METRICS, "log_odds_ratio", "log_odds_chosen")
BETAS = (0.1, 0.0, 0.5, 2.0)


def case(x: dict[str, torch.Tensor], beta: float) -> dict:
    logits = x["logits"].clone().requires_grad_(True)
    stand_in = types.SimpleNamespace(
        beta=beta, is_encoder_decoder=False, padding_value=0, aux_loss_enabled=False, accelerator=accelerator(),
        concatenated_inputs=ORPOTrainer.concatenated_inputs, get_batch_logps=ORPOTrainer.get_batch_logps)
    stand_in.concatenated_forward = lambda model, batch: ORPOTrainer.concatenated_forward(stand_in, model, batch)
    stand_in.odds_ratio_loss = lambda c, r: ORPOTrainer.odds_ratio_loss(stand_in, c, r)
    loss, metrics = ORPOTrainer.get_batch_loss_metrics(stand_in, stand_in_model(logits), trl_batch(x))
    loss.backward()
    return {"beta": beta, "loss": loss.detach(), "grad": logits.grad,
            "metrics": {k: torch.tensor(metrics[k]) for k in ORPO_METRICS}}


def main() -> None:
    torch.manual_seed(0)
    x = pair_inputs([3, 4, 2, 1])
    cases = [case(x, beta) for beta in BETAS]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"trl_version": str(trl.__version__), "torch_version": str(torch.__version__), "inputs": x,
                "cases": cases}, OUT)
    print(f"TRL {trl.__version__}: {len(cases)} ORPO cases -> {OUT}")
    for c in cases:
        print(f"  beta={c['beta']}: loss {c['loss'].item():.7f}, log_odds_ratio "
              f"{c['metrics']['log_odds_ratio'].item():.5f}")


if __name__ == "__main__":
    main()
