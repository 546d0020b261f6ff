#!/usr/bin/env python
"""(Re)create ``assets/tokenizer_corpus.txt`` — the shipped tokenizer training text.

You do NOT need this to rebuild the tokenizer: ``assets/build_assets.py`` reads the
committed corpus file. This script only documents how that file was made:

* every distinct text string from ``examples/data/*.jsonl`` (prompts, completions,
  chat message contents, ``text`` rows), in file order,
* chat messages again as ``role: content`` transcript lines (so that the role
  names the chat template renders become single tokens), and
* the hand-written generic English / digits / punctuation lines in
  ``assets/english_lines.txt``.

Stdlib only, deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
ROOT = ASSETS.parent
DATA = ROOT / "examples" / "data"
OUT = ASSETS / "tokenizer_corpus.txt"


def strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, list):
        for x in obj:
            yield from strings(x)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if k != "role":
                yield from strings(v)


def main() -> None:
    lines: list[str] = []
    seen: set[str] = set()

    def add(s: str) -> None:
        s = s.rstrip("\n")
        if s and s not in seen:
            seen.add(s)
            lines.append(s)

    english = (ASSETS / "english_lines.txt").read_text(encoding="utf-8").splitlines()
    for s in english:
        add(s)
    for path in sorted(DATA.glob("*.jsonl")):
        with path.open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                for s in strings(row):
                    add(s)
                # Chat transcripts ("user: ...") so role names become single tokens.
                for key in ("messages", "prompt", "chosen", "rejected"):
                    if isinstance(row.get(key), list):
                        for m in row[key]:
                            add(f"{m['role']}: {m['content']}")
                # Also the full prompt+completion string, as the model sees it.
                if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
                    add(row["prompt"] + row["completion"])
    # Hand-written text is small next to the templated data: repeat it so its merges matter.
    body = lines + english + english
    OUT.write_text("\n".join(body) + "\n", encoding="utf-8")
    print(f"wrote {len(body)} lines, {OUT.stat().st_size} bytes -> {OUT}")


if __name__ == "__main__":
    main()
