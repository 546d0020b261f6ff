"""Writes the tool-calling demo's data (deterministic): ``examples/data/tool_sft.jsonl`` (transcripts in which the
assistant calls ``calculate`` and answers with its result, for SFT) and ``examples/data/tool_prompts.jsonl``
(questions with their ``answer``, for GRPO). Run from the repository root: ``python examples/agent/make_data.py``."""

from __future__ import annotations

import json
import random
from pathlib import Path

from transformers.utils import get_json_schema

from calculator import calculate  # noqa: E402 - run as a script from this folder's parent

OUT = Path(__file__).resolve().parents[1] / "data"
SCHEMA = get_json_schema(calculate)


def question(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(11, 99), rng.randint(11, 99)
    op = rng.choice(["*", "+", "-"])
    expression = f"{a}{op}{b}"
    return expression, calculate(expression)


def transcript(expression: str, result: str) -> dict:
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
    return {"messages": [{"role": "user", "content": f"What is {expression}?"},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "name": "calculate", "content": result},
                         {"role": "assistant", "content": result}],
            "tools": [SCHEMA]}


def main() -> None:
    rng = random.Random(7)
    seen, sft, prompts = set(), [], []
    while len(sft) + len(prompts) < 800:
        expression, result = question(rng)
        if expression in seen:
            continue
        seen.add(expression)
        if len(sft) < 400:
            sft.append(transcript(expression, result))
        else:
            prompts.append({"prompt": [{"role": "user", "content": f"What is {expression}?"}], "answer": result})
    for name, rows in (("tool_sft.jsonl", sft), ("tool_prompts.jsonl", prompts)):
        (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} rows to {OUT / name}")


if __name__ == "__main__":
    main()
