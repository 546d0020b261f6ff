"""TRL 1.16's vision SFT batches (``DataCollatorForVisionLanguageModeling``) on rows of the shipped demo data with
the shipped tiny Qwen2-VL processor, saved for tests/vision/test_vlm_sft.py to compare with ours.

Regenerate by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    make .venv-bench/.installed      # if the bench venv is not there yet
    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/trl_parity/sft_vlm.py   # writes tests/fixtures/trl_sft_vlm_parity.pt

Nothing of lightalign is imported. The processor is the folder's ``Qwen2VLProcessor`` without its video processor
(transformers builds that half only with torchvision, absent from both venvs): the same class with ``video_processor``
left out of its attributes. Cases, each TRL's collator called on the same rows as ``SFTTrainer`` calls it:
``messages`` rows (lines 1, 18 and 3 of ``vlm_sft.jsonl``, line 18 with two images) with the whole sequence as the
target and with ``assistant_only_loss``; prompt-completion rows made from the same conversations (the user turn the
prompt, the answer the completion) with ``completion_only_loss``. Saved per case: the rows (as the JSONL holds them)
and every tensor of the batch, except ``pixel_values`` (300 KB a case), kept as its shape and its float64 sum and sum
of squares (the pixels come from the same image processor in both venvs; the tests compare them exactly with the
processor's own batch).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image
from transformers import Qwen2VLProcessor
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "fixtures" / "trl_sft_vlm_parity.pt"
DATA = REPO / "examples" / "data" / "vlm_sft.jsonl"
ROWS = (0, 17, 2)  # a one-image row, a two-image row, a one-image row


def processor() -> Qwen2VLProcessor:
    attributes = [a for a in Qwen2VLProcessor.get_attributes() if a != "video_processor"]
    image_only = type("Qwen2VLProcessor", (Qwen2VLProcessor,),
                      {"get_attributes": classmethod(lambda _: list(attributes))})
    return image_only.from_pretrained(REPO / "assets" / "models" / "tiny-qwen2-vl")


def with_pil(row: dict) -> dict:
    """The row as ``SFTTrainer`` hands it to the collator: ``images`` opened (datasets' image feature decodes them)."""
    images = [Image.open(DATA.parent / path).convert("RGB") for path in row["images"]]
    return {**row, "images": images}


def main() -> None:
    lines = DATA.read_text().splitlines()
    rows = [json.loads(lines[i]) for i in ROWS]
    assert any(len(r["images"]) == 2 for r in rows), "a two-image row is part of the cases"
    pc_rows = [{"prompt": [r["messages"][0]], "completion": [r["messages"][1]], "images": r["images"]} for r in rows]
    proc = processor()
    cases = {}
    for name, case_rows, kwargs in (
            ("messages", rows, {"completion_only_loss": False}),
            ("messages_assistant_only", rows, {"completion_only_loss": False, "assistant_only_loss": True}),
            ("prompt_completion", pc_rows, {"completion_only_loss": True})):
        collator = DataCollatorForVisionLanguageModeling(proc, **kwargs)
        batch = collator([with_pil(json.loads(json.dumps(r))) for r in case_rows])
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "pixel_values"}
        pixels = batch["pixel_values"].double()
        tensors["pixel_values_stats"] = torch.tensor([*pixels.shape, pixels.sum(), (pixels ** 2).sum()],
                                                     dtype=torch.float64)
        cases[name] = {"rows": json.dumps(case_rows), "kwargs": json.dumps(kwargs), "batch": tensors}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save(cases, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): " + ", ".join(
        f"{n}: {sorted(c['batch'])}" for n, c in cases.items()))


if __name__ == "__main__":
    main()
