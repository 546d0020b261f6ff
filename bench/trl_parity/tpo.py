"""TRL 1.16's TPO loss on fixed tensors, saved for tests/tpo/test_tpo_parity.py to compare with ours.

Regenerate by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    make .venv-bench/.installed      # if the bench venv is not there yet
    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/trl_parity/tpo.py   # writes tests/fixtures/trl_tpo_parity.pt

Nothing of lightalign is imported: the inputs are seeded token ids and logits, the outputs are what TRL's own code
returns. The batch is TRL's own ``DataCollatorForTriplePreference`` output for three seeded triples (with the
gold ``reference`` rows, and without them as TRL collates for ``tpo_alpha = 0``); ``TPOTrainer._compute_loss``
(a method; called on a stand-in ``self`` carrying only what it reads: ``beta``, ``loss_type``,
``label_smoothing``, ``tpo_alpha``, ``tpo_l_gamma``, ``model.training``, an ``accelerator`` whose gathers are the
identity (one process), the metrics dict, the token counter and ``_tp_size``) runs with a stand-in model that
returns the seeded logits, so TRL's selective log-softmax, its sums or per-token means, its loss types and its NLL
term on the gold response (as TRL adds it) all run. Cases: every ``loss_type`` x ``beta`` 0.01 (TRL's default)
and 0.5 x ``label_smoothing`` 0 and 0.2 x ``tpo_alpha`` 0 and 1, plus ``tpo-l`` with ``tpo_l_gamma`` 1.5 and
``tpo_alpha`` 0.5. Saved per case: the knobs, the loss, its gradient with respect to the logits and TRL's logged
metrics.

The file is small (about 95 kB; regenerating it reproduces it byte for byte): tensors in a dict, loadable with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import types
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
import trl  # noqa: E402
from trl.experimental.tpo.tpo_trainer import DataCollatorForTriplePreference, TPOTrainer  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "trl_tpo_parity.pt"
VOCAB = 8
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "tpo-l")


def triples() -> list[dict[str, list[int]]]:
    """Three triples of token ids: prompts and completions of different lengths (the longest sets the width)."""
    g = torch.Generator().manual_seed(2405)
    shapes = [(3, 2, 4, 3), (1, 5, 1, 2), (4, 1, 2, 4)]  # (prompt, chosen, rejected, reference) lengths
    rows = []
    for lengths in shapes:
        ids = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]
        rows.append(dict(zip(("prompt_ids", "chosen_ids", "rejected_ids", "reference_ids"), ids)))
    return rows


def case(batch: dict[str, torch.Tensor], logits: torch.Tensor, loss_type: str, beta: float, label_smoothing: float,
         tpo_alpha: float, tpo_l_gamma: float = 0.5) -> dict:
    leaf = logits.clone().requires_grad_(True)
    stand_in = types.SimpleNamespace(
        beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, tpo_alpha=tpo_alpha, tpo_l_gamma=tpo_l_gamma,
        model=types.SimpleNamespace(training=True), _metrics={"train": defaultdict(list)}, _total_train_tokens=0,
        _tp_size=1, accelerator=types.SimpleNamespace(gather_for_metrics=lambda v: v, gather=lambda v: v))
    model = lambda **kwargs: types.SimpleNamespace(logits=leaf)  # noqa: E731
    loss = TPOTrainer._compute_loss(stand_in, model, batch, return_outputs=False)
    loss.backward()
    metrics = {k: float(v[0]) for k, v in stand_in._metrics["train"].items()}
    return {"loss_type": loss_type, "beta": beta, "label_smoothing": label_smoothing, "tpo_alpha": tpo_alpha,
            "tpo_l_gamma": tpo_l_gamma, "loss": loss.detach(), "grad": leaf.grad, "metrics": metrics}


def main() -> None:
    torch.manual_seed(0)
    rows = triples()
    with_reference = DataCollatorForTriplePreference(pad_token_id=0)(rows)
    without = DataCollatorForTriplePreference(pad_token_id=0, include_reference=False)(rows)
    g = torch.Generator().manual_seed(16)
    logits = torch.randn(*with_reference["input_ids"].shape, VOCAB, generator=g) * 2.0
    # the pair batch holds the first 2B rows of the triple batch, as wide as its longest row
    pair_logits = logits[: without["input_ids"].shape[0], : without["input_ids"].shape[1]].contiguous()
    cases = []
    for loss_type in LOSS_TYPES:
        for beta in (0.01, 0.5):
            for label_smoothing in (0.0, 0.2):
                for tpo_alpha in (0.0, 1.0):
                    batch, x = (with_reference, logits) if tpo_alpha else (without, pair_logits)
                    cases.append(case(batch, x, loss_type, beta, label_smoothing, tpo_alpha))
    cases.append(case(with_reference, logits, "tpo-l", 0.5, 0.0, 0.5, tpo_l_gamma=1.5))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"trl_version": str(trl.__version__), "torch_version": str(torch.__version__), "rows": rows,
                "batch": dict(with_reference), "pair_batch": dict(without), "logits": logits,
                "pair_logits": pair_logits, "cases": cases}, OUT)
    print(f"TRL {trl.__version__}: {len(cases)} TPO cases -> {OUT}")
    for c in cases:
        print(f"  {c['loss_type']:7s} beta={c['beta']} ls={c['label_smoothing']} alpha={c['tpo_alpha']} "
              f"gamma={c['tpo_l_gamma']}: {c['loss'].item():.7f}")


if __name__ == "__main__":
    main()
