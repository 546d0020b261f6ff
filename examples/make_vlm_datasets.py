#!/usr/bin/env python
"""Generate the small, deterministic vision-language example datasets shipped in ``examples/data/``.

Each image is a 56x56 RGB picture: a white 4x4 grid of 14-pixel cells, some holding one flat-coloured shape (a
square, a circle or a triangle in red, green, blue or yellow). Every question about an image has a short answer
that can be checked against the drawn scene: a count, a colour, left/right, yes/no, first/second. Shapes are
rasterised here in plain Python (not with ``ImageDraw``, whose anti-aliasing and rounding differ between Pillow
versions) and only encoded to PNG by Pillow, so re-running the script reproduces the committed pixels exactly and
the JSONL files byte for byte (fixed seeds, fixed iteration order)::

    python examples/make_vlm_datasets.py            # writes examples/data/vlm_*.jsonl and examples/data/vlm_images/
    python examples/make_vlm_datasets.py --out DIR  # somewhere else

Formats follow TRL's conventions for images: an ``images`` column (a list of paths, relative to the JSONL file's
folder) and conversational user content as parts, one ``{"type": "image"}`` per image followed by the question's
``{"type": "text", "text": ...}`` (see ``examples/data/README.md`` and ``docs/vlm.md``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import NamedTuple

from PIL import Image

SEED = 5050
DATA_DIR = Path(__file__).resolve().parent / "data"
IMAGE_DIR = "vlm_images"  # beside the JSONL files; rows name their images relative to the JSONL file's folder

SIZE, CELL, GRID, INSET = 56, 14, 4, 2  # a shape fills a 10x10 box inset 2 pixels into its 14x14 cell
BOX = CELL - 2 * INSET
BACKGROUND = (255, 255, 255)
COLORS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 70, 220), "yellow": (235, 200, 20)}
KINDS = ("square", "circle", "triangle")

# Rows per file; the image count is larger by the two-image rows.
N_SFT, N_SFT_TWO_IMAGES, N_SFT_VAL, N_PROMPTS, N_PREFERENCE, N_KTO = 200, 20, 40, 160, 100, 100

# Question kinds and how often each is drawn: the dominant colour is the easy one (a tiny model learns it within
# minutes), counting and positions are harder.
QUESTION_WEIGHTS = {"dominant": 4, "count_color": 2, "count_kind": 1, "count_all": 1, "side": 1, "exists": 1}


class Shape(NamedTuple):
    kind: str
    color: str
    row: int
    col: int


Scene = tuple[Shape, ...]


# Drawing ----------------------------------------------------------------------------


def _inside(kind: str, x: int, y: int) -> bool:
    """Whether pixel (x, y) of the 10x10 box (its centre at x + 0.5, y + 0.5) belongs to the shape."""
    cx, cy, r = x + 0.5 - BOX / 2, y + 0.5, BOX / 2
    if kind == "square":
        return True
    if kind == "circle":
        return cx * cx + (cy - r) ** 2 <= r * r
    return abs(cx) <= cy / BOX * r  # triangle: apex at the top centre, base along the bottom row


MASKS = {kind: [[_inside(kind, x, y) for x in range(BOX)] for y in range(BOX)] for kind in KINDS}
AREAS = {kind: sum(map(sum, mask)) for kind, mask in MASKS.items()}  # pixels: square 100, circle 80, triangle 50


def area(scene: Scene, color: str) -> int:
    """How many pixels the scene's shapes of ``color`` cover."""
    return sum(AREAS[s.kind] for s in scene if s.color == color)


def render(scene: Scene) -> Image.Image:
    """The scene as a 56x56 RGB image, pixel by pixel (no anti-aliasing: every pixel is the background or a
    shape's colour)."""
    pixels = bytearray(bytes(BACKGROUND) * (SIZE * SIZE))
    for shape in scene:
        rgb = bytes(COLORS[shape.color])
        top, left = shape.row * CELL + INSET, shape.col * CELL + INSET
        for y, mask_row in enumerate(MASKS[shape.kind]):
            for x, filled in enumerate(mask_row):
                if filled:
                    at = ((top + y) * SIZE + left + x) * 3
                    pixels[at:at + 3] = rgb
    return Image.frombytes("RGB", (SIZE, SIZE), bytes(pixels))


def random_scene(rng: random.Random, n: int, allowed=lambda kind, color: True, fixed: tuple = ()) -> Scene:
    """``fixed`` (kind, colour) shapes plus ``n`` random ones that ``allowed`` accepts, in distinct random cells,
    listed in cell order."""
    specs = list(fixed)
    while len(specs) < len(fixed) + n:
        kind, color = rng.choice(KINDS), rng.choice(sorted(COLORS))
        if allowed(kind, color):
            specs.append((kind, color))
    rng.shuffle(specs)
    cells = rng.sample(range(GRID * GRID), len(specs))
    return tuple(sorted((Shape(k, c, cell // GRID, cell % GRID) for (k, c), cell in zip(specs, cells)),
                        key=lambda s: (s.row, s.col)))


# Questions --------------------------------------------------------------------------


def question(rng: random.Random, kind: str) -> tuple[Scene, str, str, list[str]]:
    """A scene, a question about it, the right answer and the plausible wrong answers."""
    colors = sorted(COLORS)
    if kind == "dominant":
        color = rng.choice(colors)
        k = rng.randint(2, 4)
        while True:
            n_others, fixed = rng.randint(0, 3), [(rng.choice(KINDS), color) for _ in range(k)]
            scene = random_scene(rng, n_others, lambda _k, c: c != color, fixed=fixed)
            # The answer is both the colour of most shapes and the colour covering the most pixels (easy to learn).
            if all(sum(s.color == c for s in scene) < k and area(scene, c) < area(scene, color)
                   for c in colors if c != color):
                break
        return scene, "What color are most of the shapes?", color, [c for c in colors if c != color]
    if kind == "count_color":
        color, n = rng.choice(colors), rng.randint(0, 4)
        fixed = [(rng.choice(KINDS), color) for _ in range(n)]
        scene = random_scene(rng, rng.randint(0 if n else 1, 3), lambda _k, c: c != color, fixed=fixed)
        return scene, f"How many {color} shapes are there?", str(n), _near_counts(n)
    if kind == "count_kind":
        shape_kind, n = rng.choice(KINDS), rng.randint(0, 4)
        fixed = [(shape_kind, rng.choice(colors)) for _ in range(n)]
        scene = random_scene(rng, rng.randint(0 if n else 1, 3), lambda k, _c: k != shape_kind, fixed=fixed)
        return scene, f"How many {shape_kind}s are there?", str(n), _near_counts(n)
    if kind == "count_all":
        n = rng.randint(1, 7)
        return random_scene(rng, n), "How many shapes are there?", str(n), _near_counts(n)
    if kind == "side":
        target = (rng.choice(KINDS), rng.choice(colors))
        scene = random_scene(rng, rng.randint(1, 4), lambda k, c: (k, c) != target, fixed=[target])
        (shape,) = [s for s in scene if (s.kind, s.color) == target]
        side = "left" if shape.col < GRID // 2 else "right"
        return (scene, f"Is the {target[1]} {target[0]} on the left or on the right?", side,
                ["right" if side == "left" else "left"])
    if kind == "exists":
        target, present = (rng.choice(KINDS), rng.choice(colors)), rng.random() < 0.5
        scene = random_scene(rng, rng.randint(1, 4), lambda k, c: (k, c) != target, fixed=[target] if present else [])
        return scene, f"Is there a {target[1]} {target[0]}?", "yes" if present else "no", ["no" if present else "yes"]
    raise ValueError(f"unknown question kind {kind!r}")


def two_image_question(rng: random.Random) -> tuple[tuple[Scene, Scene], str, str, list[str]]:
    """Two scenes with different numbers of circles: which has more."""
    a, b = rng.sample(range(5), 2)
    scenes = tuple(random_scene(rng, rng.randint(0 if n else 1, 3), lambda k, _c: k != "circle",
                                fixed=[("circle", rng.choice(sorted(COLORS))) for _ in range(n)]) for n in (a, b))
    answer = "first" if a > b else "second"
    return scenes, "Which image has more circles, the first or the second?", answer, ["second" if a > b else "first"]


def _near_counts(n: int) -> list[str]:
    return [str(m) for m in (n - 1, n + 1, n + 2) if m >= 0]


def draw_kind(rng: random.Random) -> str:
    kinds = list(QUESTION_WEIGHTS)
    return rng.choices(kinds, weights=[QUESTION_WEIGHTS[k] for k in kinds])[0]


# Writers ----------------------------------------------------------------------------


class ImageWriter:
    """Saves scenes as ``vlm_images/<prefix>_NNNN.png`` and returns their paths relative to the data folder."""

    def __init__(self, out: Path, prefix: str):
        self.folder, self.prefix, self.count = out / IMAGE_DIR, prefix, 0

    def __call__(self, *scenes: Scene) -> list[str]:
        paths = []
        for scene in scenes:
            self.count += 1
            name = f"{IMAGE_DIR}/{self.prefix}_{self.count:04d}.png"
            render(scene).save(self.folder.parent / name, format="PNG", optimize=True)
            paths.append(name)
        return paths


def user_turn(text: str, n_images: int) -> dict:
    return {"role": "user", "content": [*({"type": "image"} for _ in range(n_images)), {"type": "text", "text": text}]}


def assistant_turn(text: str) -> dict:
    return {"role": "assistant", "content": text}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows):5d} rows -> {path}")


def sft_rows(rng: random.Random, images: ImageWriter, n: int, n_two: int) -> list[dict]:
    """``n`` one-image rows with ``n_two`` two-image rows spread among them."""
    two_at = set(rng.sample(range(n), n_two))
    rows = []
    for i in range(n):
        if i in two_at:
            scenes, text, answer, _wrong = two_image_question(rng)
        else:
            scene, text, answer, _wrong = question(rng, draw_kind(rng))
            scenes = (scene,)
        rows.append({"messages": [user_turn(text, len(scenes)), assistant_turn(answer)], "images": images(*scenes)})
    return rows


def build(out: Path, seed: int = SEED) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / IMAGE_DIR).mkdir(exist_ok=True)
    for stale in (out / IMAGE_DIR).glob("*.png"):  # the folder holds exactly the images the rows name
        stale.unlink()

    # Conversational SFT, with a disjoint validation file.
    write_jsonl(out / "vlm_sft.jsonl", sft_rows(random.Random(seed), ImageWriter(out, "sft"), N_SFT, N_SFT_TWO_IMAGES))
    write_jsonl(out / "vlm_sft_val.jsonl", sft_rows(random.Random(seed + 1), ImageWriter(out, "sft_val"), N_SFT_VAL, 4))

    # Prompt-only with the reference answer (GRPO, RLOO, online DPO rewards).
    rng, images, rows = random.Random(seed + 2), ImageWriter(out, "prompts"), []
    for _ in range(N_PROMPTS):
        scene, text, answer, _wrong = question(rng, draw_kind(rng))
        rows.append({"prompt": [user_turn(text, 1)], "images": images(scene), "answer": answer})
    write_jsonl(out / "vlm_prompts.jsonl", rows)

    # Conversational preference: the right answer chosen, a plausible wrong one rejected.
    rng, images, rows = random.Random(seed + 3), ImageWriter(out, "preference"), []
    for _ in range(N_PREFERENCE):
        scene, text, answer, wrong = question(rng, draw_kind(rng))
        rows.append({"prompt": [user_turn(text, 1)], "chosen": [assistant_turn(answer)],
                     "rejected": [assistant_turn(rng.choice(wrong))], "images": images(scene)})
    write_jsonl(out / "vlm_preference.jsonl", rows)

    # Unpaired preference (KTO): one completion per prompt, the right answer (desirable) with probability 0.6, else a
    # wrong one.
    rng, images, rows = random.Random(seed + 4), ImageWriter(out, "kto"), []
    for _ in range(N_KTO):
        scene, text, answer, wrong = question(rng, draw_kind(rng))
        good = rng.random() < 0.6
        completion = answer if good else rng.choice(wrong)
        rows.append({"prompt": [user_turn(text, 1)], "completion": [assistant_turn(completion)], "label": good,
                     "images": images(scene)})
    write_jsonl(out / "vlm_kto.jsonl", rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DATA_DIR)
    build(ap.parse_args().out)


if __name__ == "__main__":
    main()
