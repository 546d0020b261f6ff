"""TRL 1.16's GMPO loss on fixed tensors, saved for tests/online_rl/test_gmpo_parity.py to compare with ours.

Regenerate by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    make .venv-bench/.installed      # if the bench venv is not there yet
    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/trl_parity/gmpo.py   # writes tests/fixtures/trl_gmpo_parity.pt

Nothing of lightalign is imported: the inputs are seeded tensors, the outputs are what TRL's own code returns.
``GMPOTrainer._compute_loss`` (a method; called on a stand-in ``self`` carrying only what it reads: the clip range
``epsilon_low``/``epsilon_high``, ``beta``, ``top_entropy_quantile``, ``model.training``,
``current_gradient_accumulation_steps`` (1, so the loss is not divided: Lightning divides by the accumulation),
an ``accelerator`` whose reduce/gather are the identity (one process), the metrics dict, and a
``_get_per_token_logps_and_entropies`` that returns the seeded per-token log-probs instead of running a model, and
``get_high_entropy_mask`` returning a fixed token mask). Cases: TRL's GMPO clip range (``epsilon`` 0.4) and an
asymmetric one (0.2 / 0.28), ``beta`` 0 and 0.04, with and without the high-entropy token mask, off-policy (given
``old_per_token_logps``) and on-policy (none); plus the default case on a batch holding a completion without real
tokens. Saved per case: the knobs, the loss and its gradient with respect to the per-token log-probs.

The file is small (~23 kB; regenerating it reproduces it byte for byte): tensors in a dict, loadable with
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
from trl.experimental.gmpo import GMPOTrainer  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "trl_gmpo_parity.pt"
CLIP_RANGES = ((0.4, None), (0.2, 0.28))  # (epsilon, epsilon_high); TRL's GMPOConfig default first
BETAS = (0.0, 0.04)


def inputs(empty_row: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4321)
    b, t = 5, 7
    logps = -torch.rand(b, t, generator=g) * 3.0 - 0.05
    old = logps + torch.randn(b, t, generator=g) * 0.5  # many token log-ratios beyond +-0.4: the clip acts
    ref = logps + torch.randn(b, t, generator=g) * 0.3
    lengths = torch.tensor([7, 5, 3, 6, 1])
    if empty_row:
        lengths[2] = 0
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).long()
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9])
    entropies = torch.rand(b, t, generator=g) * 2.0
    entropy_mask = (torch.rand(b, t, generator=g) > 0.4) & mask.bool()
    entropy_mask[0, 0] = True  # every row with tokens keeps at least one
    return {"per_token_logps": logps, "old_per_token_logps": old, "ref_per_token_logps": ref,
            "completion_mask": mask, "advantages": advantages, "entropies": entropies, "entropy_mask": entropy_mask}


def case(x: dict[str, torch.Tensor], epsilon: float, epsilon_high: float | None, beta: float, entropy: bool,
         on_policy: bool) -> dict:
    logps = x["per_token_logps"].clone().requires_grad_(True)
    b, t = logps.shape
    stand_in = types.SimpleNamespace(
        epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high, beta=beta,
        top_entropy_quantile=0.5 if entropy else 1.0, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        accelerator=types.SimpleNamespace(reduce=lambda v, reduction: v, gather=lambda v: v),
        _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, x["entropies"], None),
        get_high_entropy_mask=lambda entropies, mask, threshold: x["entropy_mask"].to(mask.dtype),
    )
    batch = {"prompt_ids": torch.zeros(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
             "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": x["completion_mask"],
             "advantages": x["advantages"], "ref_per_token_logps": x["ref_per_token_logps"]}
    if not on_policy:
        batch["old_per_token_logps"] = x["old_per_token_logps"]
    loss = GMPOTrainer._compute_loss(stand_in, None, batch)
    loss.backward()
    return {"epsilon": epsilon, "epsilon_high": epsilon_high, "beta": beta, "entropy_mask": entropy,
            "on_policy": on_policy, "loss": loss.detach(), "grad": logps.grad,
            "clip_ratio/region_mean": torch.tensor(stand_in._metrics["train"]["clip_ratio/region_mean"][0])}


def main() -> None:
    torch.manual_seed(0)
    x, x_empty = inputs(), inputs(empty_row=True)
    cases = [case(x, eps, eps_high, beta, entropy, on_policy)
             for eps, eps_high in CLIP_RANGES for beta in BETAS for entropy in (False, True)
             for on_policy in (False, True)]
    empty = [case(x_empty, 0.4, None, 0.0, False, False)]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"trl_version": str(trl.__version__), "torch_version": str(torch.__version__), "inputs": x,
                "cases": cases, "inputs_with_empty_row": x_empty, "empty_row_cases": empty}, OUT)
    print(f"TRL {trl.__version__}: {len(cases)} + {len(empty)} GMPO cases -> {OUT}")
    for c in cases + empty:
        print(f"  eps={c['epsilon']} eps_high={c['epsilon_high']} beta={c['beta']} entropy={c['entropy_mask']} "
              f"on_policy={c['on_policy']}: {c['loss'].item():.7f} (clipped {c['clip_ratio/region_mean'].item():.3f})")


if __name__ == "__main__":
    main()
