"""The quickstart from Python: ``lightalign.Trainer(...).fit(SFTModule(...), SFTDataModule(...))``.

Run from the repository root:  python examples/sft_python.py [--max-steps 300]
The run of ``lightalign fit --config configs/quickstart.yaml`` with the same knobs: it trains the shipped tiny model
(random weights from assets/models/tiny/config.json) on the shipped arithmetic data and writes what that command
writes, into runs/python-quickstart/version_N/ (metrics.csv, checkpoints/last.ckpt, hf_model/, curves.png,
versions.json; hparams.yaml holds the module's knobs where the console keeps config.yaml), then generates from the
export.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightalign import SFTDataModule, SFTModule, Trainer

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--model", default=str(ROOT / "assets" / "models" / "tiny"))
    args = parser.parse_args()

    L.seed_everything(42)  # the console's seed_everything default
    module = SFTModule(
        args.model,
        from_config=True,  # the shipped tiny model has a config, no weights; drop this for a real checkpoint
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_ratio=0.05,
        weight_decay=0.01,
    )
    data = SFTDataModule(
        str(ROOT / "examples" / "data" / "arithmetic_sft.jsonl"),
        tokenizer=args.model,
        val_path=str(ROOT / "examples" / "data" / "arithmetic_sft_val.jsonl"),
        max_length=64,
        batch_size=32,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.max_steps,
        val_check_interval=100,
        check_val_every_n_epoch=None,
        limit_val_batches=10,
        gradient_clip_val=1.0,
        name="python-quickstart",  # runs/python-quickstart/version_N
        checkpoint={"every_n_train_steps": 100},  # the config's checkpoint: and plot: sections
        plot={"enabled": True},
    )
    trainer.fit(module, data)

    export = trainer.run_dir / "hf_model"
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    for prompt in ("12+7=", "45-3=", "8+80="):
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        print(prompt, tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))


if __name__ == "__main__":
    main()
