"""TRL 1.16's distillation losses on fixed tensors, saved for tests/distill/test_distill_losses.py to compare with ours.

Regenerate by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    make .venv-bench/.installed      # if the bench venv is not there yet
    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/trl_parity/gkd.py   # writes tests/fixtures/trl_gkd_parity.pt

Nothing of lightalign is imported: the inputs are seeded tensors, the outputs are what TRL's own functions return.

* GKD: ``GKDTrainer.generalized_jsd_loss`` (a staticmethod) on student/teacher logits ``[3, 6, 11]`` with labels
  that are -100 on prompt and padding positions (one sequence fully masked) for beta 0, 0.1, 0.5, 0.9, 1 and
  temperature 1, 2, with TRL's default ``reduction="batchmean"``; plus one case with ``num_items_in_batch``. Saved
  per case: the loss and its gradient with respect to the student logits.
* On-policy distillation: ``IWOPDTrainer._compute_iw_opd_loss`` (a method; called on a stand-in ``self`` carrying
  only the attributes it reads: ``temperature``, ``iw_opd_gamma``, ``iw_opd_epsilon``, ``model.training`` and the
  metrics dict) with the teacher's sampled-token log-probs computed as TRL's local-teacher path computes them, for
  gamma 0 (plain on-policy distillation) and 0.5 (TRL's default), temperature 1 and 2, with and without the
  sampler's ``rollout_logprobs``. Saved per case: the loss and its gradient with respect to the student logits.

The file is small (~32 kB; regenerating it reproduces it byte for byte): tensors in a dict, loadable with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import types
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import trl  # noqa: E402
from trl.experimental.gkd import GKDTrainer  # noqa: E402
from trl.experimental.iw_opd import IWOPDTrainer  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "trl_gkd_parity.pt"
BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)
TEMPERATURES = (1.0, 2.0)
GAMMAS = (0.0, 0.5)


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    b, t, v = 3, 6, 11
    student = torch.randn(b, t, v, generator=g) * 2.0
    teacher = torch.randn(b, t, v, generator=g) * 3.0
    tokens = torch.randint(0, v, (b, t), generator=g)
    labels = tokens.clone()
    labels[0, :2] = -100  # prompt
    labels[1, :1] = -100
    labels[1, 4:] = -100  # padding after the completion
    labels[2, :] = -100  # a sequence with nothing to learn
    rollout = F.log_softmax(torch.randn(b, t, v, generator=g), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return {"student_logits": student, "teacher_logits": teacher, "tokens": tokens, "labels": labels,
            "rollout_logprobs": rollout}


def gkd_case(x: dict[str, torch.Tensor], beta: float, temperature: float, num_items_in_batch=None):
    student = x["student_logits"].clone().requires_grad_(True)
    loss = GKDTrainer.generalized_jsd_loss(student, x["teacher_logits"], labels=x["labels"], beta=beta,
                                           temperature=temperature, num_items_in_batch=num_items_in_batch)
    loss.backward()
    return {"beta": beta, "temperature": temperature, "num_items_in_batch": num_items_in_batch,
            "loss": loss.detach(), "grad": student.grad}


def iw_opd_case(x: dict[str, torch.Tensor], gamma: float, temperature: float, with_rollout: bool):
    stand_in = types.SimpleNamespace(temperature=temperature, iw_opd_gamma=gamma, iw_opd_epsilon=1e-8,
                                     model=types.SimpleNamespace(training=True),
                                     _metrics={"train": defaultdict(list)})
    teacher_logprobs = F.log_softmax(x["teacher_logits"] / temperature, dim=-1).gather(
        dim=-1, index=x["tokens"].unsqueeze(-1)).squeeze(-1)
    student = x["student_logits"].clone().requires_grad_(True)
    loss = IWOPDTrainer._compute_iw_opd_loss(stand_in, student_logits=student, completion_tokens=x["tokens"],
                                             labels=x["labels"], teacher_actual_logprobs=teacher_logprobs,
                                             rollout_logprobs=x["rollout_logprobs"] if with_rollout else None)
    loss.backward()
    return {"gamma": gamma, "temperature": temperature, "with_rollout": with_rollout,
            "teacher_logprobs": teacher_logprobs, "loss": loss.detach(), "grad": student.grad}


def main() -> None:
    torch.manual_seed(0)
    x = inputs()
    gkd = [gkd_case(x, beta, temperature) for beta in BETAS for temperature in TEMPERATURES]
    gkd.append(gkd_case(x, 0.5, 2.0, num_items_in_batch=17))
    iw_opd = [iw_opd_case(x, gamma, temperature, with_rollout) for gamma in GAMMAS for temperature in TEMPERATURES
              for with_rollout in (False, True)]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"trl_version": str(trl.__version__), "torch_version": str(torch.__version__), "inputs": x, "gkd": gkd,
                "iw_opd": iw_opd}, OUT)
    print(f"TRL {trl.__version__}: {len(gkd)} GKD and {len(iw_opd)} IW-OPD cases -> {OUT}")
    for case in gkd:
        print(f"  gkd beta={case['beta']} T={case['temperature']} n={case['num_items_in_batch']}: "
              f"{case['loss'].item():.7f}")
    for case in iw_opd:
        print(f"  iw_opd gamma={case['gamma']} T={case['temperature']} rollout={case['with_rollout']}: "
              f"{case['loss'].item():.7f}")


if __name__ == "__main__":
    main()
