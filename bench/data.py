"""Benchmark data of a chosen length shape, written as JSONL at run time (deterministic; nothing big is shipped).

Two shapes, same mean length:

* ``uniform``: every text has the mean length;
* ``longtail``: lengths drawn from a log-normal (sigma 1) scaled to the same mean, clipped to [4, 4 x mean] —
  most texts short, a few long: the mix where padding wastes most.

Texts are sentences of ``assets/english_lines.txt`` (what the shipped tokenizer was trained on, so about one token
per word). Four kinds, in TRL's formats: ``sft`` (prompt-completion, loss on the completion), ``preference``
(prompt / chosen / rejected, chosen and rejected of different lengths), ``unpaired`` (prompt / completion / label,
for KTO: labels alternate true, false, so every batch of 2+ rows holds both kinds), ``prompts`` (prompt only, for
GRPO and RLOO).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ("uniform", "longtail")
KINDS = ("sft", "preference", "unpaired", "prompts")


def words() -> list[str]:
    lines = (ROOT / "assets" / "english_lines.txt").read_text(encoding="utf-8").splitlines()
    return [w for line in lines for w in line.split()]


def draw_lengths(shape: str, mean: int, n: int, rng: random.Random) -> list[int]:
    """``n`` lengths (in words) of the given shape, averaging about ``mean``."""
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is unknown; use one of {SHAPES}.")
    if mean < 4:
        raise ValueError(f"mean length must be >= 4 words, got {mean}.")
    if shape == "uniform":
        return [mean] * n
    sigma = 1.0
    mu = math.log(mean) - sigma * sigma / 2  # E[lognormal] = exp(mu + sigma^2 / 2) = mean
    return [min(4 * mean, max(4, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def text(vocab: list[str], length: int, rng: random.Random) -> str:
    start = rng.randrange(len(vocab))
    return " ".join(vocab[(start + i) % len(vocab)] for i in range(length))


def rows(kind: str, shape: str, n: int, mean: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``kind``; ``mean`` is the mean length in words of a whole example (prompt + completion)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is unknown; use one of {KINDS}.")
    rng, vocab = random.Random(seed), words()
    lengths = draw_lengths(shape, mean, n, rng)
    out = []
    for i, total in enumerate(lengths):
        prompt_len = max(2, total // 4)
        rest = max(2, total - prompt_len)
        if kind in ("sft", "unpaired"):
            out.append({"prompt": text(vocab, prompt_len, rng), "completion": " " + text(vocab, rest, rng)})
            if kind == "unpaired":
                out[-1]["label"] = i % 2 == 0
        elif kind == "preference":
            other = max(2, round(rest * rng.uniform(0.5, 1.5)))
            out.append({"prompt": text(vocab, prompt_len, rng), "chosen": " " + text(vocab, rest, rng),
                        "rejected": " " + text(vocab, other, rng)})
        else:
            out.append({"prompt": text(vocab, total, rng)})
    return out


def write(path: Path, kind: str, shape: str, n: int, mean: int, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows(kind, shape, n, mean, seed):
            f.write(json.dumps(row) + "\n")
    return path
