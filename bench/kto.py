"""KTO parity: lightalign's KTOModule vs TRL's KTOTrainer, end to end on the same rows, the same initial weights and
a few plain-SGD steps; prints the largest difference of the final weights (and of the per-step losses).

Run by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    make .venv-bench/.installed   # or: python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0 \
                                  #     && .venv-bench/bin/pip install -e '.[bench]'
    .venv-bench/bin/python bench/kto.py [--rows 64] [--steps 4] [--batch-size 8] [--loss-type kto]

Matched settings: the tiny model built once under a fixed seed and saved (both load that folder), float32, no
dropout, no gradient checkpointing, SGD at a constant learning rate, TRL's sequential order (``shuffle: false``
here), ``max_length`` on both sides, the reference a frozen copy of the initial model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "assets" / "models" / "tiny"


def build_model(out: Path, seed: int) -> None:
    from lightalign.hub import load_causal_lm, load_tokenizer

    torch.manual_seed(seed)
    load_causal_lm(str(TINY), from_config=True).save_pretrained(out)
    load_tokenizer(str(TINY)).save_pretrained(out)


def run_lightalign(model_dir: Path, rows: list[dict], args: argparse.Namespace) -> tuple[dict, list[float]]:
    import lightning as L
    from datasets import Dataset

    from lightalign import KTOModule, UnpairedPreferenceDataModule

    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    module = KTOModule(str(model_dir), beta=args.beta, loss_type=args.loss_type, lr_scheduler_type="constant",
                       optimizer=lambda params: torch.optim.SGD(params, lr=args.lr), recompute_mlp_activation=False)
    data = UnpairedPreferenceDataModule(Dataset.from_list(rows), tokenizer=str(model_dir), max_length=args.max_length,
                                        batch_size=args.batch_size, shuffle=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[Losses()])
    trainer.fit(module, data)
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}, losses


def run_trl(model_dir: Path, rows: list[dict], args: argparse.Namespace, workdir: Path) -> tuple[dict, list[float]]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import KTOConfig, KTOTrainer

    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = KTOConfig(output_dir=str(workdir / "trl"), per_device_train_batch_size=args.batch_size,
                       max_steps=args.steps, learning_rate=args.lr, optim="sgd", lr_scheduler_type="constant",
                       beta=args.beta, loss_type=args.loss_type, max_length=args.max_length,
                       gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, logging_steps=1,
                       save_strategy="no", report_to=[], disable_dropout=True, seed=args.seed,
                       weight_decay=0.0, max_grad_norm=0.0)
    trainer = KTOTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Losses()])
    trainer.train()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "arithmetic_unpaired.jsonl"))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--loss-type", default="kto", choices=["kto", "apo_zero_unpaired"])
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lines = Path(args.data).read_text().splitlines()[: args.rows]
    rows = [json.loads(line) for line in lines]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        build_model(workdir / "model", args.seed)
        ours, our_losses = run_lightalign(workdir / "model", rows, args)
        theirs, their_losses = run_trl(workdir / "model", rows, args, workdir)
    shared = [k for k in ours if k in theirs]
    if len(shared) != len(ours):
        sys.exit(f"parameter names differ: {sorted(set(ours) ^ set(theirs))[:4]}")
    worst = max(shared, key=lambda k: float((ours[k].float() - theirs[k].float()).abs().max()))
    moved = max(float((ours[k].float() - theirs[k].float()).abs().max()) for k in shared)
    print(f"rows {len(rows)}, steps {args.steps}, batch {args.batch_size}, loss_type {args.loss_type}")
    print(f"losses lightalign {['%.6f' % x for x in our_losses]}")
    print(f"losses TRL        {['%.6f' % x for x in their_losses]}")
    print(f"final weights: max |lightalign - TRL| = {moved:.3e} (at {worst})")


if __name__ == "__main__":
    main()
