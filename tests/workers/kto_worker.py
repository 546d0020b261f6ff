"""One KTO step under ``--devices N`` (DDP, gloo) with precomputed reference log-probs; each rank dumps what it saw
(used by tests/kto/test_kto_ddp.py).

python tests/workers/kto_worker.py --devices 2 --out DIR
Writes DIR/rank<r>.json: the reference log-probs it ended with (every row), its own micro-batch's KL estimate,
its mean over the ranks, and the KL term the loss used (clamped at 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
from datasets import Dataset

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "assets" / "models" / "tiny")
DATA = REPO / "examples" / "data"
sys.path.insert(0, str(REPO / "tests"))  # helpers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from helpers.fork_ranks import fork_ranks

    fork_ranks(args.devices)  # the other ranks forked from this process (tests/helpers/fork_ranks.py)
    from lightalign import KTOModule, UnpairedPreferenceDataModule

    class Recording(KTOModule):
        def mean_over_ranks(self, value):
            self.seen = (float(value), float(super().mean_over_ranks(value)))
            return super().mean_over_ranks(value)

        def kl_term(self, batch, ref_kl_logps):
            kl = super().kl_term(batch, ref_kl_logps)
            if self.training and not hasattr(self, "record"):
                logps, kl_logps = self.trainer.datamodule.reference_logps["train"]
                self.record = {"local": self.seen[0], "mean": self.seen[1], "kl": float(kl), "logps": logps.tolist(),
                               "kl_logps": kl_logps.tolist()}
                (out / f"rank{self.global_rank}.json").write_text(json.dumps(self.record))
            return kl

    lines = (DATA / "arithmetic_unpaired.jsonl").read_text().splitlines()[:9]
    rows = Dataset.from_list([json.loads(line) for line in lines])
    L.seed_everything(1234)
    module = Recording(TINY, from_config=True, precompute_ref_log_probs=True, learning_rate=0.05,
                       ref_log_probs_cache_dir=str(out / f"cache{args.devices}"))
    # a policy that differs from its reference, so the KL estimates are not all zero
    module.configure_model()
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    data = UnpairedPreferenceDataModule(rows, tokenizer=TINY, batch_size=2, val_batch_size=4, max_length=32)
    strategy = "ddp" if args.devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    trainer.fit(module, data)


if __name__ == "__main__":
    main()
