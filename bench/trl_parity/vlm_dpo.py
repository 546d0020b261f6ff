"""TRL 1.16's DPO batch of image rows (``DataCollatorForVisionPreference``) on the shipped tiny Qwen2-VL's processor,
saved for tests/vision/test_vlm_trl_parity.py to compare with the batch of lightalign's ``PreferenceCollator``.

Regenerate by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    make .venv-bench/.installed      # if the bench venv is not there yet
    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/trl_parity/vlm_dpo.py   # writes tests/fixtures/trl_vlm_dpo_parity.pt

Nothing of lightalign is imported. The bench venv has no torchvision, so the processor is built image-only (its
class without the video processor, as lightalign's ``load_processor`` does). Two cases of two pairs with one image
each (plain-coloured 56x56 PIL images; the test writes the same pixels to PNG): ``parts``, prompts with
``{"type": "image"}`` parts, and ``strings``, prompts with string contents (TRL's ``prepare_multimodal_messages``
adds the image part; a dataset column holds one kind, so the kinds are two cases). Saved per case: TRL's
``input_ids``, ``attention_mask``, ``completion_mask``, ``mm_token_type_ids``, ``image_grid_thw`` and the
``pixel_values`` of the chosen rows (TRL repeats them for the rejected rows; checked here), stored once for both
cases (the same images). Whatever the model,
the same tensors give the same forward, so equal batches make equal DPO losses.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import Qwen2VLProcessor  # noqa: E402
from trl.trainer.dpo_trainer import DataCollatorForVisionPreference  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "trl_vlm_dpo_parity.pt"
MODEL = ROOT / "assets" / "models" / "tiny-qwen2-vl"
SIZES = ((56, 56), (56, 56))  # the smallest image Qwen2-VL takes (its min_pixels): 16 patches
COLOURS = ((220, 30, 30), (30, 200, 40))


def rows(parts: bool) -> list[dict]:
    """The pairs of a case (the test builds the same ones)."""
    def user(text):
        return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}] if parts else text}]

    def say(text):
        return [{"role": "assistant", "content": text}]

    return [{"prompt": user("How many shapes?"), "chosen": say("two"), "rejected": say("seven red")},
            {"prompt": user("Which colour?"), "chosen": say("green"), "rejected": say("blue")}]


def image_only_processor():
    attributes = [a for a in Qwen2VLProcessor.get_attributes() if a != "video_processor"]
    cls = type("Qwen2VLProcessor", (Qwen2VLProcessor,), {"get_attributes": classmethod(lambda _: list(attributes)),
                                                          "__module__": Qwen2VLProcessor.__module__})
    return cls.from_pretrained(str(MODEL))


def trl_batch(processor, parts: bool) -> dict[str, torch.Tensor]:
    examples = [dict(row, images=[Image.new("RGB", size, colour)])
                for row, size, colour in zip(rows(parts), SIZES, COLOURS)]
    batch = DataCollatorForVisionPreference(processor)(examples)
    pixels, half = batch["pixel_values"], batch["pixel_values"].shape[0] // 2
    assert torch.equal(pixels[:half], pixels[half:]), "TRL repeats each prompt's images for its rejected row"
    saved = {key: batch[key].clone() for key in ("input_ids", "attention_mask", "completion_mask",
                                                  "mm_token_type_ids", "image_grid_thw")}
    saved["chosen_pixel_values"] = pixels[:half].clone()
    return saved


def main() -> None:
    processor = image_only_processor()
    saved = {case: trl_batch(processor, case == "parts") for case in ("parts", "strings")}
    # the same images in both cases: their pixel values are stored once
    assert torch.equal(saved["parts"]["chosen_pixel_values"], saved["strings"]["chosen_pixel_values"])
    saved["chosen_pixel_values"] = saved["strings"].pop("chosen_pixel_values")
    del saved["parts"]["chosen_pixel_values"]
    torch.save(saved, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): "
          + ", ".join(f"{k} {tuple(v.shape)}" for k, v in {**saved["parts"], **saved}.items() if torch.is_tensor(v)))


if __name__ == "__main__":
    main()
