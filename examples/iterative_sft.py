"""Iterative SFT in your own loop: generate -> keep the completions a reward function likes -> ``step`` on them.

Run from the repository root:  python examples/iterative_sft.py [--rounds 6]
The shipped tiny model (random weights) is pushed towards answering the arithmetic prompts in digits: each round
samples completions, keeps the best-scoring one of each prompt when it scores above the round's mean
(``digit_fraction_reward``), and takes one optimisation step on the kept (prompt, completion) pairs.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from lightalign import IterativeSFT
from lightalign.rewards import digit_fraction_reward

ROOT = Path(__file__).resolve().parent.parent


def main(rounds: int = 6, prompts_per_round: int = 16, samples: int = 4, seed: int = 0) -> list[float]:
    """Returns the mean reward of the sampled completions of each round."""
    random.seed(seed)
    torch.manual_seed(seed)
    rows = [json.loads(line) for line in open(ROOT / "examples" / "data" / "arithmetic_prompts.jsonl")]
    trainer = IterativeSFT(str(ROOT / "assets" / "models" / "tiny"), from_config=True, learning_rate=3e-3,
                           max_length=32, truncation_mode="keep_end", device="cpu")
    history = []
    for round_ in range(rounds):
        prompts = [r["prompt"] for r in random.sample(rows, prompts_per_round)]
        repeated = [p for p in prompts for _ in range(samples)]
        completions = trainer.generate(repeated, max_new_tokens=6, do_sample=True, temperature=1.0)
        rewards = digit_fraction_reward(repeated, completions)
        mean = sum(rewards) / len(rewards)
        keep_prompts, keep_completions = [], []
        for i, prompt in enumerate(prompts):
            group = range(i * samples, (i + 1) * samples)
            best = max(group, key=lambda j: rewards[j])
            if rewards[best] > mean and completions[best].strip():
                keep_prompts.append(prompt)
                keep_completions.append(completions[best])
        history.append(mean)
        if not keep_prompts:
            print(f"round {round_}: mean reward {mean:.3f}, nothing kept")
            continue
        stats = trainer.step(texts=keep_prompts, texts_labels=keep_completions)
        print(f"round {round_}: mean reward {mean:.3f}, kept {len(keep_prompts)}, loss {stats['loss']:.3f}")
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    main(parser.parse_args().rounds)
