"""DPO batches of image rows equal TRL 1.16's (``DataCollatorForVisionPreference`` on the same rows and the same
processor; tests/fixtures/trl_vlm_dpo_parity.pt, written by bench/trl_parity/vlm_dpo.py in the bench venv): the
same tensors reach the same model, so the DPO loss is TRL's; the loss on such a batch is checked against a
hand-built one in test_vlm_preference.py."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from lightalign import PreferenceDataModule  # noqa: E402
from lightalign.vision import load_processor  # noqa: E402

SIZES = ((56, 56), (56, 56))
COLOURS = ((220, 30, 30), (30, 200, 40))


def _rows(parts: bool) -> list[dict]:
    """bench/trl_parity/vlm_dpo.py's pairs, with their images as PNG files."""
    def user(text):
        return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}] if parts else text}]

    def say(text):
        return [{"role": "assistant", "content": text}]

    return [{"prompt": user("How many shapes?"), "chosen": say("two"), "rejected": say("seven red"),
             "images": ["img0.png"]},
            {"prompt": user("Which colour?"), "chosen": say("green"), "rejected": say("blue"), "images": ["img1.png"]}]


@pytest.mark.parametrize("case", ["parts", "strings"])
def test_dpo_batch_of_image_rows_equals_trls(repo, tmp_path, case):
    """Mutations: the collator not repeating the images for the rejected rows (``ImageInputs.cat([x])``) -> the
    pixel values differ; ``with_image_parts`` putting the image part after the text -> the ids differ (strings)."""
    saved = torch.load(repo / "tests/fixtures/trl_vlm_dpo_parity.pt", weights_only=True)
    expected = saved[case]
    for i, (size, colour) in enumerate(zip(SIZES, COLOURS)):
        Image.new("RGB", size, colour).save(tmp_path / f"img{i}.png")
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _rows(case == "parts")))
    processor = load_processor(str(repo / "assets/models/tiny-qwen2-vl"))
    dm = PreferenceDataModule(str(path), processor, prompt_sharing=False, batch_size=2, shuffle=False)
    dm.setup("fit")
    batch = dm.collate_fn()([dm.train_dataset[i] for i in range(2)])
    for key in ("input_ids", "attention_mask", "completion_mask", "mm_token_type_ids"):
        assert torch.equal(batch[key], expected[key]), key
    tensors = batch["image_inputs"].tensors()
    assert torch.equal(tensors["image_grid_thw"], expected["image_grid_thw"])
    torch.testing.assert_close(tensors["pixel_values"], saved["chosen_pixel_values"].repeat(2, 1), atol=0, rtol=0)
