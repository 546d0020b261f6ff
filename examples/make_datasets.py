#!/usr/bin/env python
"""Generate the small, deterministic example datasets shipped in ``examples/data/``.

Standard library only. Re-running this script reproduces the committed files
byte for byte (fixed seed, fixed iteration order)::

    python examples/make_datasets.py            # writes examples/data/*.jsonl
    python examples/make_datasets.py --out DIR  # somewhere else

Formats follow TRL conventions (see ``examples/data/README.md``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

SEED = 1234
DATA_DIR = Path(__file__).resolve().parent / "data"

WORDS = [
    "apple", "banana", "cherry", "dog", "cat", "house", "river", "garden", "pencil",
    "window", "orange", "lemon", "tiger", "horse", "mouse", "table", "chair", "bread",
    "water", "music", "light", "stone", "cloud", "green", "happy", "planet", "rocket",
    "forest", "winter", "summer", "spring", "autumn", "yellow", "purple", "silver",
    "guitar", "piano", "letter", "paper", "school", "teacher", "doctor", "market",
    "bottle", "candle", "flower", "monkey", "rabbit", "turtle", "zebra", "kite",
    "lamp", "moon", "sun", "star", "tree", "bird", "fish", "book", "door", "road",
    "ship", "train", "plane", "city", "snow", "rain", "wind", "fire", "sand",
]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a friendly math tutor.",
]

# Arithmetic -------------------------------------------------------------------------


def all_problems() -> list[tuple[int, str, int]]:
    """Every a+b and a-b (a >= b, so results are non-negative) with a, b in 0..99."""
    probs = []
    for a in range(100):
        for b in range(100):
            probs.append((a, "+", b))
            if a >= b:
                probs.append((a, "-", b))
    return probs


def solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def prompt_str(a: int, op: str, b: int) -> str:
    return f"{a}{op}{b}="


def wrong_answer(rng: random.Random, correct: int) -> int:
    """A plausible wrong answer: off by a small non-zero amount, never negative."""
    while True:
        delta = rng.choice([-3, -2, -1, 1, 2, 3, 10, -10])
        cand = correct + delta
        if cand >= 0:
            return cand


def question_text(rng: random.Random, a: int, op: str, b: int) -> str:
    word = "plus" if op == "+" else "minus"
    templates = [
        f"What is {a} {word} {b}?",
        f"Compute {a} {op} {b}.",
        f"What is {a}{op}{b}?",
        f"Calculate {a} {word} {b}.",
    ]
    return rng.choice(templates)


def answer_text(rng: random.Random, a: int, op: str, b: int) -> str:
    word = "plus" if op == "+" else "minus"
    c = solve(a, op, b)
    templates = [
        f"{a} {word} {b} is {c}.",
        f"{a} {op} {b} = {c}",
        f"The answer is {c}.",
    ]
    return rng.choice(templates)


# Short instructions -----------------------------------------------------------------


def instruction_pair(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["reverse", "upper", "count", "first", "last", "repeat"])
    w = rng.choice(WORDS)
    if kind == "reverse":
        return rng.choice([f"Reverse the word {w}", f"Reverse: {w}"]), w[::-1]
    if kind == "upper":
        return rng.choice([f"Uppercase: {w}", f"Write {w} in capital letters."]), w.upper()
    if kind == "count":
        return rng.choice([f"Count the letters in {w}", f"How many letters are in {w}?"]), str(len(w))
    if kind == "first":
        return f"What is the first letter of {w}?", w[0]
    if kind == "last":
        return f"What is the last letter of {w}?", w[-1]
    n = rng.randint(2, 3)
    return f"Repeat {w} {n} times.", " ".join([w] * n)


def user_assistant_pair(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        a, op, b = rng.choice(PROBLEMS)
        return question_text(rng, a, op, b), answer_text(rng, a, op, b)
    return instruction_pair(rng)


# Text LM ----------------------------------------------------------------------------

COLORS = {"apple": "red", "banana": "yellow", "lemon": "yellow", "orange": "orange",
          "cherry": "red", "grass": "green", "sky": "blue", "snow": "white", "coal": "black"}
ANIMAL_SOUNDS = {"dog": "barks", "cat": "meows", "cow": "moos", "duck": "quacks",
                 "lion": "roars", "horse": "neighs", "sheep": "bleats", "bird": "sings"}
PEOPLE = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy"]
PLACES = ["the park", "the market", "school", "the library", "the beach", "the station", "home"]
ITEMS = ["apples", "books", "coins", "pencils", "cards", "stones", "cookies", "shells"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def text_row(rng: random.Random) -> str:
    kind = rng.randrange(7)
    if kind == 0:
        thing, color = rng.choice(sorted(COLORS.items()))
        return f"The color of {thing} is {color}."
    if kind == 1:
        animal, sound = rng.choice(sorted(ANIMAL_SOUNDS.items()))
        return f"The {animal} {sound}."
    if kind == 2:
        a, op, b = rng.choice(PROBLEMS)
        word = "plus" if op == "+" else "minus"
        return f"{a} {word} {b} equals {solve(a, op, b)}."
    if kind == 3:
        p, place, day = rng.choice(PEOPLE), rng.choice(PLACES), rng.choice(DAYS)
        return f"On {day}, {p} went to {place}."
    if kind == 4:
        p, q = rng.sample(PEOPLE, 2)
        n, m, w = rng.randint(1, 9), rng.randint(2, 9), rng.choice(ITEMS)
        return f"{q} had {m} {w}. {p} gave {q} {n} more. Now {q} has {m + n} {w}."
    if kind == 5:
        w = rng.choice(WORDS)
        return f"The word {w} has {len(w)} letters and starts with {w[0]}."
    i = DAYS.index(rng.choice(DAYS))
    return f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}."


# Writers ----------------------------------------------------------------------------

PROBLEMS = all_problems()


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows):5d} rows -> {path}")


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)

    # Disjoint train/val split of arithmetic problems.
    rng = random.Random(SEED)
    shuffled = PROBLEMS[:]
    rng.shuffle(shuffled)
    train, val = shuffled[:3000], shuffled[3000:3200]
    write_jsonl(out / "arithmetic_sft.jsonl",
                [{"prompt": prompt_str(*p), "completion": str(solve(*p))} for p in train])
    write_jsonl(out / "arithmetic_sft_val.jsonl",
                [{"prompt": prompt_str(*p), "completion": str(solve(*p))} for p in val])

    # Conversational SFT.
    rng = random.Random(SEED + 1)
    rows = []
    for _ in range(1000):
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _turn in range(2 if rng.random() < 0.25 else 1):
            u, a = user_assistant_pair(rng)
            msgs.append({"role": "user", "content": u})
            msgs.append({"role": "assistant", "content": a})
        rows.append({"messages": msgs})
    write_jsonl(out / "chat_sft.jsonl", rows)

    # Plain text LM.
    rng = random.Random(SEED + 2)
    write_jsonl(out / "text_lm.jsonl", [{"text": text_row(rng)} for _ in range(1000)])

    # Preference (standard, explicit prompt).
    rng = random.Random(SEED + 3)
    rows = []
    for a, op, b in rng.sample(PROBLEMS, 1000):
        c = solve(a, op, b)
        rows.append({"prompt": prompt_str(a, op, b), "chosen": str(c),
                     "rejected": str(wrong_answer(rng, c))})
    write_jsonl(out / "arithmetic_preference.jsonl", rows)
    write_jsonl(out / "arithmetic_tpo.jsonl", [tpo_row(r) for r in rows])

    # Preference (conversational).
    rng = random.Random(SEED + 4)
    rows = []
    for a, op, b in rng.sample(PROBLEMS, 500):
        c = solve(a, op, b)
        word = "plus" if op == "+" else "minus"
        rows.append({
            "prompt": [{"role": "user", "content": f"What is {a} {word} {b}?"}],
            "chosen": [{"role": "assistant", "content": str(c)}],
            "rejected": [{"role": "assistant", "content": str(wrong_answer(rng, c))}],
        })
    write_jsonl(out / "chat_preference.jsonl", rows)

    # Prompt-only (for GRPO / online methods), with the reference answer.
    rng = random.Random(SEED + 5)
    write_jsonl(out / "arithmetic_prompts.jsonl",
                [{"prompt": prompt_str(*p), "answer": str(solve(*p))}
                 for p in rng.sample(PROBLEMS, 1000)])

    # Unpaired preference (for KTO): one completion per prompt, judged desirable (the right answer) or not; about
    # 60% desirable, so the classes are unequal as in real feedback data.
    rng = random.Random(SEED + 6)
    rows = []
    for a, op, b in rng.sample(PROBLEMS, 1000):
        c = solve(a, op, b)
        good = rng.random() < 0.6
        rows.append({"prompt": prompt_str(a, op, b), "completion": str(c if good else wrong_answer(rng, c)),
                     "label": good})
    write_jsonl(out / "arithmetic_unpaired.jsonl", rows)

    # Format preference (for reward models a tiny model can learn): the answer in digits is preferred to the same
    # answer in words, the preference GRPO's digit_fraction_reward encodes by hand.
    rng = random.Random(SEED + 7)
    write_jsonl(out / "digit_preference.jsonl",
                [{"prompt": prompt_str(a, op, b), "chosen": str(solve(a, op, b)), "rejected": number_words(solve(a, op, b))}
                 for a, op, b in rng.sample(PROBLEMS, 1000)])

    # Prompts with privileged context (for self-distillation, SDFT): the teacher also sees a worked answer, the
    # student only the prompt.
    rng = random.Random(SEED + 8)
    write_jsonl(out / "arithmetic_privileged.jsonl",
                [{"prompt": prompt_str(a, op, b), "privileged_context": f"Answer: {solve(a, op, b)}",
                  "answer": str(solve(a, op, b))} for a, op, b in rng.sample(PROBLEMS, 500)])


_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen").split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()


def tpo_row(pair: dict) -> dict:
    """A TPO triple from an arithmetic preference pair, without randomness: the gold ``reference`` is the correct
    answer (the pair's chosen), ``chosen`` the near miss (the pair's rejected, off by 1, 2, 3 or 10), ``rejected``
    a far miss: the result of the other operation (``a-b`` for ``a+b=`` and back), or, when that equals one of the
    others (``b`` of 0 or 5), the near miss mirrored about the correct answer."""
    a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", pair["prompt"]).groups()
    correct, near = int(pair["chosen"]), int(pair["rejected"])
    far = solve(int(a), "-" if op == "+" else "+", int(b))
    if far in (correct, near):
        far = 2 * correct - near
    return {"prompt": pair["prompt"], "chosen": str(near), "rejected": str(far), "reference": str(correct)}


def number_words(n: int) -> str:
    """English words of 0 <= n < 1000 (``103`` -> ``one hundred three``)."""
    if n >= 100:
        rest = n % 100
        return f"{_ONES[n // 100]} hundred" + (f" {number_words(rest)}" if rest else "")
    if n < 20:
        return _ONES[n]
    return _TENS[n // 10 - 2] + (f"-{_ONES[n % 10]}" if n % 10 else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DATA_DIR)
    build(ap.parse_args().out)


if __name__ == "__main__":
    main()
