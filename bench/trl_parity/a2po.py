"""TRL 1.16's A*-PO on fixed inputs, saved for tests/online_rl/test_a2po.py to compare with ours.

Regenerate by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    make .venv-bench/.installed      # if the bench venv is not there yet
    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/trl_parity/a2po.py   # writes tests/fixtures/trl_a2po_parity.pt

Nothing of lightalign is imported: the inputs are seeded tensors, the outputs are what TRL's own code returns.

* The value estimate: ``A2POTrainer._estimate_optimal_values`` runs on a stand-in ``self`` carrying only what it
  reads: ``args`` (``beta1``, ``num_value_samples``, ``per_device_train_batch_size``, ``max_prompt_length``,
  ``filter_all_incorrect``), a train dataset of prompts ``p0 .. p5``, an ``accelerator`` whose ``prepare`` is the
  identity (one process, CPU), a tokenizer that encodes prompt ``pj`` as the id ``j`` and decodes a completion id as
  its text, a reference model whose ``generate`` appends the id ``j * N + i`` to sample ``i`` of prompt ``j``, and
  TRL's own ``_calculate_rewards`` with a reward function returning the seeded reward of that sample (the trainer
  module's ``unwrap_model_for_generation`` is replaced by a context that yields the model: one process, nothing to
  unwrap). Saved per case (``beta1`` 0.5 (TRL's default), 0.1, 2.0; binary rewards with two prompts whose samples all
  scored 0, and continuous rewards): the rewards ``[P, N]``, TRL's ``V*`` per prompt and the prompts it keeps with
  ``filter_all_incorrect``.
* The loss: ``A2POTrainer.compute_loss`` on a stand-in ``self`` (``args.beta2``, ``model.training``, the metrics
  dict, ``model_kwarg_keys`` without ``logits_to_keep``) and TRL's own ``_get_sequence_logps`` on a stand-in model
  whose forward returns seeded logits; the inputs are TRL's (prompt-completion ids, the attention mask with the
  completion mask through the first EOS, the reference's sequence log-probs, rewards, ``V*``). Saved per case
  (``beta2`` 1e-3 (TRL's default), 0.05, 1.0): the loss, its gradient with respect to the logits, and TRL's
  ``implicit_reward`` and ``advantage`` metrics.

The file is small (~20 kB): tensors and numbers in a dict, loadable with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import BatchEncoding  # noqa: E402
from trl.experimental.a2po import a2po_trainer  # noqa: E402
from trl.experimental.a2po.a2po_trainer import A2POTrainer  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "trl_a2po_parity.pt"
BETA1S = (0.5, 0.1, 2.0)
BETA2S = (1e-3, 0.05, 1.0)
P, N = 6, 4  # prompts, reference samples per prompt


def seeded_rewards(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    if kind == "binary":
        rewards = (torch.rand(P, N, generator=g) > 0.5).float()
        rewards[1] = 0.0  # two prompts whose reference samples all scored 0
        rewards[4] = 0.0
        rewards[2] = 1.0
        return rewards
    return torch.randn(P, N, generator=g) * 1.5 + 0.3


class Tokenizer:
    """Prompt ``pj`` is the id ``j``; an id decodes as its number."""

    def __call__(self, texts, **kwargs):
        ids = torch.tensor([[int(t[1:])] for t in texts])
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(int(row[-1])) for row in ids]


class Reference:
    """Sample ``i`` of prompt ``j`` is the one token ``j * N + i``."""

    def generate(self, input_ids, attention_mask, generation_config):
        n = generation_config.num_return_sequences
        rows = input_ids.repeat_interleave(n, 0)
        samples = rows[:, :1] * n + torch.arange(n).repeat(input_ids.shape[0]).unsqueeze(1)
        return torch.cat([rows, samples], dim=1)


def value_case(kind: str, beta1: float) -> dict:
    rewards = seeded_rewards(kind)

    def reward(prompts, completions, **kwargs):
        return [float(rewards.flatten()[int(c)]) for c in completions]

    a2po_trainer.unwrap_model_for_generation = lambda model, accelerator: contextlib.nullcontext(model)
    stand_in = types.SimpleNamespace(
        args=types.SimpleNamespace(beta1=beta1, num_value_samples=N, per_device_train_batch_size=4,
                                   max_prompt_length=None, filter_all_incorrect=True),
        train_dataset=Dataset.from_list([{"prompt": f"p{j}"} for j in range(P)]), eval_dataset=None,
        accelerator=types.SimpleNamespace(prepare=lambda x: x, device=torch.device("cpu")),
        processing_class=Tokenizer(), ref_model=Reference(),
        value_generation_config=types.SimpleNamespace(num_return_sequences=N),
        reward_funcs=[reward], reward_weights=torch.ones(1),
    )
    stand_in._calculate_rewards = types.MethodType(A2POTrainer._calculate_rewards, stand_in)
    A2POTrainer._estimate_optimal_values(stand_in)
    values = torch.tensor([stand_in._optimal_values[f"p{j}"] for j in range(P)])
    kept = torch.tensor([int(p[1:]) for p in stand_in.train_dataset["prompt"]])
    return {"kind": kind, "beta1": beta1, "rewards": rewards, "values": values, "kept": kept}


def loss_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4321)
    b, prompt, t, vocab = 5, 3, 6, 11
    logits = torch.randn(b, prompt + t, vocab, generator=g) * 2.0
    completion_ids = torch.randint(0, vocab, (b, t), generator=g)
    lengths = torch.tensor([6, 4, 1, 5, 3])
    completion_mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).long()
    prompt_mask = torch.ones(b, prompt, dtype=torch.long)
    prompt_mask[1, 0] = 0  # a left-padded prompt
    return {"logits": logits, "prompt_ids": torch.randint(0, vocab, (b, prompt), generator=g),
            "completion_ids": completion_ids, "prompt_mask": prompt_mask, "completion_mask": completion_mask,
            "ref_logps": -torch.rand(b, generator=g) * 10.0 - 2.0,
            "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]),
            "v_star": torch.rand(b, generator=g) * 0.8 + 0.1}


def loss_case(x: dict[str, torch.Tensor], beta2: float) -> dict:
    logits = x["logits"].clone().requires_grad_(True)
    model = lambda **inputs: types.SimpleNamespace(logits=logits)  # noqa: E731
    stand_in = types.SimpleNamespace(args=types.SimpleNamespace(beta2=beta2),
                                     model=types.SimpleNamespace(training=True),
                                     _metrics={"train": defaultdict(list)}, model_kwarg_keys={"input_ids"})
    stand_in._get_sequence_logps = types.MethodType(A2POTrainer._get_sequence_logps, stand_in)
    t = x["completion_ids"].shape[1]
    inputs = {"input_ids": torch.cat([x["prompt_ids"], x["completion_ids"]], dim=1),
              "attention_mask": torch.cat([x["prompt_mask"], x["completion_mask"]], dim=1), "logits_to_keep": t,
              "ref_logps": x["ref_logps"], "rewards": x["rewards"], "v_star": x["v_star"]}
    loss = A2POTrainer.compute_loss(stand_in, model, inputs)
    loss.backward()
    metrics = stand_in._metrics["train"]
    return {"beta2": beta2, "loss": loss.detach(), "grad": logits.grad,
            "implicit_reward": torch.tensor(metrics["implicit_reward"][0]),
            "advantage": torch.tensor(metrics["advantage"][0])}


def main() -> None:
    torch.manual_seed(0)
    values = [value_case(kind, beta1) for kind in ("binary", "continuous") for beta1 in BETA1S]
    x = loss_inputs()
    losses = [loss_case(x, beta2) for beta2 in BETA2S]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"trl_version": str(trl.__version__), "torch_version": str(torch.__version__),
                "value_cases": values, "loss_inputs": x, "loss_cases": losses}, OUT)
    print(f"TRL {trl.__version__}: {len(values)} value cases, {len(losses)} loss cases -> {OUT}")
    for c in values:
        print(f"  {c['kind']} beta1={c['beta1']}: V* {[round(v, 4) for v in c['values'].tolist()]} kept "
              f"{c['kept'].tolist()}")
    for c in losses:
        print(f"  beta2={c['beta2']}: loss {c['loss'].item():.7f}")


if __name__ == "__main__":
    main()
