"""The shipped vision-language demo data: the generator rebuilds it exactly, every row's images exist and match its
image placeholders, and every answer is right for the picture, recounted here from the pixels (not taken from the
generator's scene description)."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from lightalign.rewards import accuracy_reward

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data"
FILES = ("vlm_sft", "vlm_sft_val", "vlm_prompts", "vlm_preference", "vlm_kto")
CONVERSATION_COLUMNS = ("messages", "prompt", "chosen", "rejected", "completion")
BACKGROUND = (255, 255, 255)


def load_generator():
    spec = importlib.util.spec_from_file_location("make_vlm_datasets", REPO / "examples" / "make_vlm_datasets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]


def pixels(path: Path) -> tuple[str, tuple[int, int], bytes]:
    with Image.open(path) as image:
        return image.mode, image.size, image.tobytes()


def test_generator_rebuilds_the_shipped_files(tmp_path):
    load_generator().build(tmp_path)
    for name in FILES:
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (DATA / f"{name}.jsonl").read_bytes(), name
    built = sorted(p.name for p in (tmp_path / "vlm_images").iterdir())
    assert built == sorted(p.name for p in (DATA / "vlm_images").iterdir())
    # Pixels, not PNG bytes: the zlib inside Pillow may compress the same pixels differently on another build.
    for name in built:
        assert pixels(tmp_path / "vlm_images" / name) == pixels(DATA / "vlm_images" / name), name


def test_rows_name_existing_images_one_per_placeholder():
    named = set()
    for name in FILES:
        for i, row in enumerate(rows(name)):
            images = row["images"]
            assert images and all(not Path(p).is_absolute() for p in images), (name, i)
            placeholders = sum(part.get("type") == "image"
                               for column in CONVERSATION_COLUMNS for message in row.get(column, [])
                               if isinstance(message["content"], list) for part in message["content"])
            assert placeholders == len(images), (name, i)
            for path in images:
                mode, size, _ = pixels(DATA / path)  # relative to the JSONL file's folder
                assert (mode, size) == ("RGB", (56, 56)), (name, i, path)
                named.add(path)
    on_disk = {f"vlm_images/{p.name}" for p in (DATA / "vlm_images").iterdir()}
    assert named == on_disk  # no image missing, none unused
    assert sum((DATA / p).stat().st_size for p in on_disk) < 300_000


def test_the_images_ship_with_the_package():
    """``lightalign examples`` copies the data files and their images, and the wheel's package data names them."""
    from lightalign.shipped import shipped_files

    wanted = {f"examples/data/{name}.jsonl" for name in FILES}
    wanted |= {f"examples/data/vlm_images/{p.name}" for p in (DATA / "vlm_images").iterdir()}
    assert wanted <= {f.as_posix() for f in shipped_files(REPO)}
    package_data = re.search(r"\[tool\.setuptools\.package-data\]\s*lightalign = \[(.*?)\]",
                             (REPO / "pyproject.toml").read_text(), re.DOTALL)[1]  # no tomllib before Python 3.11
    patterns = re.findall(r'"([^"]+)"', package_data)
    in_wheel = {p.relative_to(REPO).as_posix() for pattern in patterns for p in REPO.glob(pattern) if p.is_file()}
    assert wanted <= in_wheel


# Reading a scene back from the pixels -------------------------------------------------------------------------


def color_name(rgb: tuple[int, int, int]) -> str:
    high = tuple(channel >= 128 for channel in rgb)
    names = {(1, 0, 0): "red", (0, 1, 0): "green", (0, 0, 1): "blue", (1, 1, 0): "yellow"}
    assert high in names, f"unexpected shape colour {rgb}"
    return names[high]


def filled(image: Image.Image, rgb: tuple[int, int, int]) -> int:
    return sum(n for n, color in image.getcolors() if color == rgb)


def read_scene(path: Path) -> list[tuple[str, str, int]]:
    """(kind, colour, column) of each shape in the 4x4 grid of 14-pixel cells: a cell whose centre is not white
    holds one shape, a square when its 10x10 box's top-left corner is filled, a triangle when only its bottom-left
    corner is, a circle when neither is."""
    with Image.open(path) as image:
        image = image.convert("RGB")
        shapes = []
        for row in range(4):
            for col in range(4):
                x0, y0 = col * 14, row * 14
                cell = image.crop((x0, y0, x0 + 14, y0 + 14))
                colors = {rgb for _n, rgb in cell.getcolors()}
                center = cell.getpixel((7, 7))
                if center == BACKGROUND:
                    assert colors == {BACKGROUND}, (path, row, col)
                    continue
                assert colors == {BACKGROUND, center}, (path, row, col)  # one flat shape per cell
                box = cell.crop((2, 2, 12, 12))
                assert filled(box, center) == filled(cell, center), (path, row, col)  # inside the 10x10 box
                top_left, bottom_left = cell.getpixel((2, 2)), cell.getpixel((2, 11))
                kind = "square" if top_left != BACKGROUND else "triangle" if bottom_left != BACKGROUND else "circle"
                shapes.append((kind, color_name(center), col))
        return shapes


def colour_area(path: Path) -> Counter:
    """How many pixels each shape colour covers."""
    with Image.open(path) as image:
        return Counter({color_name(rgb): n for n, rgb in image.convert("RGB").getcolors() if rgb != BACKGROUND})


def right_answer(question: str, scenes: list[list[tuple[str, str, int]]], colour_areas: list[Counter]) -> str:
    """The answer to a shipped question, worked out from the scenes read from the pixels."""
    if len(scenes) == 2:
        assert question == "Which image has more circles, the first or the second?"
        first, second = (sum(kind == "circle" for kind, _c, _x in scene) for scene in scenes)
        assert first != second
        return "first" if first > second else "second"
    (scene,) = scenes
    if question == "What color are most of the shapes?":
        (top, n), *rest = Counter(color for _k, color, _x in scene).most_common()
        assert not rest or rest[0][1] < n, "no single most frequent colour"
        (most_pixels, pixels_n), *others = colour_areas[0].most_common()
        assert most_pixels == top and (not others or others[0][1] < pixels_n), "most shapes, not most pixels"
        return top
    if question == "How many shapes are there?":
        return str(len(scene))
    if m := re.fullmatch(r"How many (red|green|blue|yellow) shapes are there\?", question):
        return str(sum(color == m[1] for _k, color, _x in scene))
    if m := re.fullmatch(r"How many (square|circle|triangle)s are there\?", question):
        return str(sum(kind == m[1] for kind, _c, _x in scene))
    if m := re.fullmatch(r"Is there a (\w+) (\w+)\?", question):
        return "yes" if (m[2], m[1]) in {(k, c) for k, c, _x in scene} else "no"
    if m := re.fullmatch(r"Is the (\w+) (\w+) on the left or on the right\?", question):
        (col,) = [x for k, c, x in scene if (k, c) == (m[2], m[1])]  # exactly one such shape
        return "left" if col < 2 else "right"
    raise AssertionError(f"unknown question {question!r}")


def question_and_answer(row: dict) -> tuple[str, str]:
    """The question text and the right answer for the row's images."""
    user = (row.get("messages") or row["prompt"])[0]
    (text,) = [part["text"] for part in user["content"] if part["type"] == "text"]
    paths = [DATA / path for path in row["images"]]
    return text, right_answer(text, [read_scene(p) for p in paths], [colour_area(p) for p in paths])


@pytest.mark.parametrize("name", FILES)
def test_answers_are_right_for_the_pixels(name):
    for i, row in enumerate(rows(name)):
        _question, answer = question_and_answer(row)
        if "messages" in row:
            assert row["messages"][1] == {"role": "assistant", "content": answer}, (name, i)
        elif "answer" in row:
            assert row["answer"] == answer, (name, i)
        elif "chosen" in row:
            assert row["chosen"][0]["content"] == answer != row["rejected"][0]["content"], (name, i)
        else:
            assert row["label"] == (row["completion"][0]["content"] == answer), (name, i)


def test_accuracy_reward_scores_the_demo_answers():
    """The GRPO demo's reward is ``accuracy_reward`` on the ``answer`` column: 1 for the right answer as a
    conversational completion (string or text parts), 0 for each wrong one the preference file offers."""
    prompts = rows("vlm_prompts")
    answers = [row["answer"] for row in prompts]
    as_string = [[{"role": "assistant", "content": a}] for a in answers]
    as_parts = [[{"role": "assistant", "content": [{"type": "text", "text": a}]}] for a in answers]
    for completions in (as_string, as_parts, answers):
        assert accuracy_reward([r["prompt"] for r in prompts], completions, answer=answers) == [1.0] * len(prompts)
    pairs = rows("vlm_preference")
    pair_prompts, gold = [r["prompt"] for r in pairs], [r["chosen"][0]["content"] for r in pairs]
    assert accuracy_reward(pair_prompts, [r["rejected"] for r in pairs], answer=gold) == [0.0] * len(pairs)
    assert accuracy_reward(pair_prompts, [r["chosen"] for r in pairs], answer=gold) == [1.0] * len(pairs)
