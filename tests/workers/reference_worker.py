"""Precompute DPO reference log-probs under ``--devices N`` (DDP, gloo) and dump each rank's view (used by
tests/dpo/test_reference_cache.py).

python tests/workers/reference_worker.py --devices 2 --rows 9 --out DIR
Writes DIR/rank<r>.json: the reference forwards that rank ran and the log-probs it ended with (every row).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
from datasets import Dataset

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "assets" / "models" / "tiny")
DATA = REPO / "examples" / "data"
sys.path.insert(0, str(REPO / "tests"))  # helpers


class Dump(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        chosen, rejected = trainer.datamodule.reference_logps["train"]
        record = {"forwards": pl_module.reference_forward_calls, "chosen": chosen.tolist(),
                  "rejected": rejected.tolist()}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--rows", type=int, default=9)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from helpers.fork_ranks import fork_ranks

    fork_ranks(args.devices)  # the other ranks forked from this process (tests/helpers/fork_ranks.py)
    from lightalign import DPOModule, PreferenceDataModule

    lines = (DATA / "arithmetic_preference.jsonl").read_text().splitlines()[: args.rows]
    rows = Dataset.from_list([json.loads(line) for line in lines])
    L.seed_everything(1234)
    module = DPOModule(TINY, from_config=True, precompute_ref_log_probs=True,
                       ref_log_probs_cache_dir=str(out / f"cache{args.devices}"))
    data = PreferenceDataModule(rows, tokenizer=TINY, batch_size=2, val_batch_size=4)
    strategy = "ddp" if args.devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[Dump(out)])
    trainer.fit(module, data)


if __name__ == "__main__":
    main()
