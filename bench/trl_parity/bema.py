"""TRL 1.16's BEMA reference (``BEMACallback`` with ``update_ref_model=True``) on a fixed weight sequence, saved for
tests/dpo/test_bema_parity.py to compare with ours.

Regenerate by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    make .venv-bench/.installed      # if the bench venv is not there yet
    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/trl_parity/bema.py   # writes tests/fixtures/trl_bema_parity.pt

Nothing of lightalign is imported. A tiny torch module (two linear layers, every parameter trainable, as TRL's
callback needs) stands in for the policy, a second instance, a copy of it, for the reference. Its weights follow a
seeded sequence: after optimizer step ``t`` every parameter has moved by a seeded Gaussian step (the same sequence
for every case, saved). TRL's own callback is driven as its trainer would drive it: ``on_train_begin`` once, then
``on_step_end`` after each step with a stand-in ``TrainerState`` carrying ``global_step`` and the reference passed
as ``ref_model`` (the experimental DPO trainer's ``CallbackHandlerWithRefModel``). Saved per case: the knobs, and
after every step the reference's weights and TRL's averaged weights (its ``running_model``), each flattened in
registration order into one row of a ``[steps, parameters]`` tensor, so a wrong schedule
shows at the step it goes wrong. Cases cover ``update_freq``, ``update_after``, ``lag``, ``multiplier``,
``ema_power``, ``bias_power`` (0 and a large one), ``min_ema_multiplier`` (a floor that acts) and the reference's
own ``ref_model_update_freq`` / ``ref_model_update_after``.

The file is small (~40 kB; regenerating it reproduces it byte for byte): tensors in a dict, loadable with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
import trl  # noqa: E402
from trl.experimental.bema_for_ref_model import BEMACallback  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "trl_bema_parity.pt"
STEPS = 14
CASES = [
    dict(update_freq=1, ref_model_update_freq=1),  # TRL's lag 10, powers 0.5 / 0.2, every step
    dict(update_freq=3, update_after=2, ref_model_update_freq=2, ref_model_update_after=1),
    dict(update_freq=2, lag=0, multiplier=2.0, ema_power=0.8, bias_power=0.5, ref_model_update_freq=2),
    dict(update_freq=1, ema_power=1.0, min_ema_multiplier=0.3, ref_model_update_freq=3, ref_model_update_after=4),
    dict(update_freq=1, ema_power=0.0, bias_power=0.0, ref_model_update_freq=1),  # EMA = theta_t, alpha = 1
    dict(update_freq=2, update_after=5, bias_power=8.0, lag=3, ref_model_update_freq=1),
    dict(update_freq=4, lag=25, multiplier=0.5, ref_model_update_freq=4, ref_model_update_after=2),
]


class Tiny(torch.nn.Module):
    """What TRL's callback needs of a model: ``type(model)(model.config)`` and a state dict."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config
        self.first = torch.nn.Linear(config["width"], 3)
        self.second = torch.nn.Linear(3, 2)


def weight_sequence() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The initial weights and the weights after each of ``STEPS`` optimizer steps."""
    g = torch.Generator().manual_seed(2508)
    init = {n: torch.randn(p.shape, generator=g) for n, p in Tiny({"width": 4}).named_parameters()}
    steps, current = [], {n: t.clone() for n, t in init.items()}
    for _ in range(STEPS):
        current = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in current.items()}
        steps.append(current)
    return init, steps


@torch.no_grad()
def run(knobs: dict, init: dict[str, torch.Tensor], steps: list[dict[str, torch.Tensor]]) -> dict:
    policy, reference = Tiny({"width": 4}), Tiny({"width": 4})
    policy.load_state_dict(init)
    reference.load_state_dict(init)
    callback = BEMACallback(update_ref_model=True, **knobs)
    state = types.SimpleNamespace(global_step=0, is_world_process_zero=True)
    callback.on_train_begin(None, state, None, model=policy)
    references, averages = [], []
    for step, weights in enumerate(steps, start=1):
        for name, param in policy.named_parameters():
            param.copy_(weights[name])
        state.global_step = step
        callback.on_step_end(None, state, None, model=policy, ref_model=reference)
        references.append(flat(reference))
        averages.append(flat(callback.running_model))
    return {"knobs": knobs, "reference": torch.stack(references), "average": torch.stack(averages)}


def flat(model: torch.nn.Module) -> torch.Tensor:
    """The parameters in registration order, flattened into one vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    init, steps = weight_sequence()
    cases = [run(knobs, init, steps) for knobs in CASES]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"trl_version": str(trl.__version__), "torch_version": str(torch.__version__), "init": init,
                "steps": steps, "cases": cases}, OUT)
    print(f"TRL {trl.__version__}: {len(cases)} BEMA cases over {STEPS} steps -> {OUT}")
    start = torch.cat([t.reshape(-1) for t in init.values()]).unsqueeze(0)
    for c in cases:
        refs = torch.cat([start, c["reference"]])
        moved = sum(not torch.equal(a, b) for a, b in zip(refs[:-1], refs[1:]))
        print(f"  {c['knobs']}: reference rewritten at {moved} of {STEPS} steps")


if __name__ == "__main__":
    main()
