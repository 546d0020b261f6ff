"""KTO parity: lightalign's KTOModule vs TRL's KTOTrainer, end to end on the same rows, the same initial weights and
a few plain-SGD steps; prints the per-step losses side by side and the largest difference of the final weights.

Run by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    make .venv-bench/.installed
    .venv-bench/bin/python bench/kto.py [--rows 64] [--steps 4] [--batch-size 8] [--loss-type kto|apo_zero_unpaired]

Matched settings: the tiny model built once under a fixed seed and saved (both load that folder), float32, no
dropout, no gradient checkpointing, plain SGD at a constant learning rate (no momentum, weight decay, warmup or
clipping), one micro-batch per step, TRL's sequential order (``shuffle: false`` here), ``max_length`` on both sides,
the reference a frozen copy of the initial model. Before the weights are compared, the script checks that the
comparison is between like things and stops otherwise: the tokenized rows (prompt, completion and mismatched KL
completion ids) are equal on both sides, and every step trained on the same rows in the same order (the
padded ``input_ids`` / ``KL_input_ids`` of each step, compared as token lists without padding).
The losses are the values each side's loss function returned (TRL's through ``compute_loss``, not its rounded logs).
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


def unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """The rows of a right-padded batch as token lists (the ``attention_mask`` ones)."""
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def run_lightalign(model_dir: Path, rows: list[dict], args: argparse.Namespace) -> dict:
    import lightning as L
    from datasets import Dataset

    from lightalign import KTOModule, UnpairedPreferenceDataModule

    seen: dict = {"losses": [], "batches": []}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["losses"].append(float(outputs["loss"]))
            seen["batches"].append((unpadded(batch["input_ids"], batch["attention_mask"]),
                                    unpadded(batch["kl_input_ids"], batch["kl_attention_mask"])
                                    if args.loss_type == "kto" else None))

    module = KTOModule(str(model_dir), beta=args.beta, loss_type=args.loss_type, lr_scheduler_type="constant",
                       optimizer=lambda params: torch.optim.SGD(params, lr=args.lr))
    data = UnpairedPreferenceDataModule(Dataset.from_list(rows), tokenizer=str(model_dir), max_length=args.max_length,
                                        batch_size=args.batch_size, shuffle=False, num_workers=0)
    trainer = L.Trainer(accelerator="cpu", max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[Record()])
    trainer.fit(module, data)
    ds = data.train_dataset
    seen["tokens"] = [(r["prompt_input_ids"], r["completion_input_ids"], r["kl_completion_input_ids"]) for r in ds]
    seen["weights"] = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    return seen


def run_trl(model_dir: Path, rows: list[dict], args: argparse.Namespace, workdir: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    seen: dict = {"losses": [], "batches": []}

    class RecordingKTOTrainer(KTOTrainer):
        def compute_loss(self, model, inputs, *a, **kw):
            loss = super().compute_loss(model, inputs, *a, **kw)
            if model.training:
                seen["losses"].append(float(loss.detach()))
                seen["batches"].append((unpadded(inputs["input_ids"], inputs["attention_mask"]),
                                        unpadded(inputs["KL_input_ids"], inputs["KL_attention_mask"])
                                        if "KL_input_ids" in inputs else None))
            return loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = KTOConfig(output_dir=str(workdir / "trl"), per_device_train_batch_size=args.batch_size,
                       gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=args.lr, optim="sgd",
                       lr_scheduler_type="constant", warmup_steps=0, beta=args.beta, loss_type=args.loss_type,
                       max_length=args.max_length, train_sampling_strategy="sequential",
                       gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, logging_steps=1,
                       save_strategy="no", report_to=[], disable_dropout=True, seed=args.seed,
                       weight_decay=0.0, max_grad_norm=0.0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = RecordingKTOTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                                  processing_class=AutoTokenizer.from_pretrained(model_dir))
    ds = trainer.train_dataset
    kl = ds["KL_completion_ids"] if "KL_completion_ids" in ds.column_names else [None] * len(ds)
    seen["tokens"] = list(zip(ds["prompt_ids"], ds["completion_ids"], kl))
    trainer.train()
    seen["weights"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return seen


def check_same_inputs(ours: dict, theirs: dict, loss_type: str) -> list[str]:
    """What makes the comparison unfair: differing tokenized rows or differing batches (empty list: none)."""
    problems = []
    if len(ours["tokens"]) != len(theirs["tokens"]):
        problems.append(f"row counts differ: lightalign {len(ours['tokens'])}, TRL {len(theirs['tokens'])}")
    for i, (a, b) in enumerate(zip(ours["tokens"], theirs["tokens"])):
        fields = ("prompt", "completion") + (("KL completion",) if loss_type == "kto" else ())
        for name, x, y in zip(fields, a, b):
            if list(x) != list(y):
                problems.append(f"row {i}: {name} ids differ: lightalign {list(x)}, TRL {list(y)}")
    if len(ours["batches"]) != len(theirs["batches"]):
        problems.append(f"step counts differ: lightalign {len(ours['batches'])}, TRL {len(theirs['batches'])}")
    for step, (a, b) in enumerate(zip(ours["batches"], theirs["batches"]), 1):
        if a[0] != b[0]:
            problems.append(f"step {step}: the batches' sequences differ")
        if loss_type == "kto" and a[1] != b[1]:
            problems.append(f"step {step}: the batches' mismatched (KL) sequences differ")
    return problems


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "arithmetic_unpaired.jsonl"))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--loss-type", default="kto", choices=["kto", "apo_zero_unpaired"])
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if -(-args.rows // args.batch_size) < args.steps:
        sys.exit(f"--rows {args.rows} make fewer than --steps {args.steps} batches of {args.batch_size}: the last "
                 "steps would wrap into a second epoch.")
    lines = Path(args.data).read_text().splitlines()[: args.rows]
    rows = [json.loads(line) for line in lines]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        build_model(workdir / "model", args.seed)
        from transformers import AutoModelForCausalLM

        initial = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32).state_dict()
        ours = run_lightalign(workdir / "model", rows, args)
        theirs = run_trl(workdir / "model", rows, args, workdir)
    import trl

    print(f"TRL {trl.__version__}: rows {len(rows)}, steps {args.steps}, batch {args.batch_size}, "
          f"loss_type {args.loss_type}, beta {args.beta}, SGD lr {args.lr}")
    problems = check_same_inputs(ours, theirs, args.loss_type)
    if problems:
        print("NOT COMPARABLE:\n  " + "\n  ".join(problems[:10]))
        sys.exit(1)
    kl = " / KL completion" if args.loss_type == "kto" else ""
    print(f"inputs: the same tokenized rows (prompt / completion{kl} ids) and the same batches in the same order on "
          "both sides")
    print("step | lightalign loss | TRL loss | |diff|")
    for step, (a, b) in enumerate(zip(ours["losses"], theirs["losses"]), 1):
        print(f"{step:4d} | {a:.8f} | {b:.8f} | {abs(a - b):.2e}")
    w_ours, w_theirs = ours["weights"], theirs["weights"]
    if set(w_ours) != set(w_theirs):
        sys.exit(f"parameter names differ: {sorted(set(w_ours) ^ set(w_theirs))[:4]}")
    diffs = {k: float((w_ours[k].float() - w_theirs[k].float()).abs().max()) for k in w_ours}
    moved = max(float((w_ours[k] - initial[k]).abs().max()) for k in w_ours)
    worst = max(diffs, key=diffs.get)
    print(f"final weights: max |lightalign - TRL| = {diffs[worst]:.3e} (at {worst}); the training moved the "
          f"weights by up to {moved:.3e}")


if __name__ == "__main__":
    main()
