"""The small A2PO run the value-stage tests share, in the test process or in a worker: 8 shipped arithmetic prompts
(one of which every reference sample scores 0), chunks of 2 prompts, 2 reference samples each, two training steps."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "assets" / "models" / "tiny"
ZERO = ("38-9=",)  # every completion of this prompt scores 0: filter_all_incorrect drops it


class Rewards:
    """Rewards that vary with the completion (its token ids), 0 for the prompts of ``ZERO``; remembers the value
    stage's calls (2 prompts x 2 samples; a rollout has 2 prompts x 1) apart from the rollouts', and SIGKILLs its
    process at value-stage call ``kill_at`` (counted from 0), after the chunks before it were written."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.value_calls, self.rollouts, self.kill_at = [], [], kill_at
        self.__name__ = "graded"

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        out = [0.0 if p in ZERO else float(sum(ids) % 5) / 4 for p, ids in zip(prompts, completion_ids)]
        if len(prompts) == 2 * 2:
            if self.kill_at is not None and len(self.value_calls) == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            self.value_calls.append((list(prompts), out))
        else:
            self.rollouts.append((list(prompts), out, [list(c) for c in completion_ids]))
        return out


def prompts() -> list[dict]:
    rows = [json.loads(line) for line in (REPO / "examples" / "data" / "arithmetic_prompts.jsonl").read_text()
            .splitlines()[:8]]
    assert ZERO[0] in [r["prompt"] for r in rows]
    return rows


def fit_a2po(cache: Path, rewards: Rewards, callbacks=()):
    """Seed 0, the tiny model from its config, the value cache in ``cache``; returns the module and the data."""
    import lightning as L
    from datasets import Dataset

    from lightalign import A2POModule, PromptDataModule

    L.seed_everything(0)
    module = A2POModule(str(TINY), from_config=True, reward_funcs=[rewards], generation_batch_size=2,
                        num_value_samples=2, beta1=0.3, max_completion_length=4, value_cache_dir=str(cache),
                        learning_rate=1e-3)
    data = PromptDataModule(Dataset.from_list(prompts()), tokenizer=str(TINY), max_prompt_length=16)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, max_steps=2, callbacks=list(callbacks))
    trainer.fit(module, data)
    return module, data
