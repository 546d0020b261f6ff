"""The shipped tiny vision-language model folders: each family's processor expands image placeholders, its random
model takes every processor output (images reach the logits), generates with images, and the folders rebuild
byte-identically."""

from __future__ import annotations

import filecmp
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ASSETS = Path(__file__).resolve().parents[2] / "assets"
_spec = importlib.util.spec_from_file_location("build_vlm_assets", ASSETS / "build_vlm_assets.py")
build_vlm_assets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_vlm_assets)

# folder -> (model class, model_type, image placeholder token, image tokens per 56x56 image)
FAMILIES = {
    "tiny-qwen2-vl": ("Qwen2VLForConditionalGeneration", "qwen2_vl", "<|image_pad|>", 4),
    "tiny-qwen2.5-vl": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "<|image_pad|>", 4),
    "tiny-qwen3-vl": ("Qwen3VLForConditionalGeneration", "qwen3_vl", "<|image_pad|>", 4),
    "tiny-gemma3": ("Gemma3ForConditionalGeneration", "gemma3", "<image_soft_token>", 16),
    "tiny-smolvlm": ("Idefics3ForConditionalGeneration", "idefics3", "<image>", 16),
    "tiny-llava": ("LlavaForConditionalGeneration", "llava", "<image>", 16),
}


def image(seed: int, size=(56, 56)) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8))


def conversation(n_images: int, question: str, answer: str | None = None) -> list[dict]:
    messages = [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": question}]}]
    if answer is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return messages


_loaded: dict[str, tuple] = {}


def load(folder: str):
    """(processor, seeded random model) of a shipped folder, built once per test run."""
    if folder not in _loaded:
        from transformers import AutoConfig, AutoModelForImageTextToText

        path = ASSETS / "models" / folder
        processor = build_vlm_assets.load_processor(path)
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path)).eval()
        if folder == "tiny-gemma3":
            # transformers initialises Gemma 3's image projection to zeros (checkpoints overwrite it): a random model
            # would ignore its images.
            projection = model.model.multi_modal_projector.mm_input_projection_weight
            assert not projection.any()
            torch.nn.init.normal_(projection, std=model.config.initializer_range)
        _loaded[folder] = (processor, model)
    return _loaded[folder]


def process(processor, rows: list[tuple[int, str]], padding_side: str = "right"):
    """One processor call over rows of (number of images, question), images 56x56, each row its own images."""
    processor.tokenizer.padding_side = padding_side
    texts = [processor.apply_chat_template(conversation(n, q), add_generation_prompt=True, tokenize=False)
             for n, q in rows]
    images = [[image(10 * r + i) for i in range(n)] for r, (n, _) in enumerate(rows)]
    return processor(text=texts, images=images, padding=True, return_tensors="pt")


@pytest.mark.parametrize("folder", FAMILIES)
def test_processor_expands_images_and_the_model_sees_them(folder):
    processor, model = load(folder)
    model_class, model_type, image_token, per_image = FAMILIES[folder]
    assert type(model).__name__ == model_class and model.config.model_type == model_type
    tokenizer = processor.tokenizer
    assert model.config.get_text_config().vocab_size == len(tokenizer)
    assert tokenizer.pad_token is not None and tokenizer.eos_token is not None

    # Plain string content renders too.
    text = processor.apply_chat_template([{"role": "user", "content": "What is 1+2?"}], add_generation_prompt=True,
                                         tokenize=False)
    assert "What is 1+2?" in text and image_token not in text

    batch = process(processor, [(2, "Which is brighter?")])
    ids = batch["input_ids"]
    image_id = tokenizer.convert_tokens_to_ids(image_token)
    assert int((ids == image_id).sum()) == 2 * per_image
    assert "pixel_values" in batch

    with torch.no_grad():
        logits = model(**batch).logits
        assert logits.shape == (*ids.shape, len(tokenizer)) and torch.isfinite(logits).all()
        # Other pixels, same tokens: the text positions after the images see them.
        other = dict(batch, pixel_values=batch["pixel_values"].flip(0) * 0.5 + 0.3)
        changed = model(**other).logits
    text_after = (ids[0] != image_id) & (torch.arange(ids.shape[1]) > int((ids[0] == image_id).nonzero().max()))
    assert (changed[0, text_after] - logits[0, text_after]).abs().max() > 1e-4

    out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 3


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("folder", FAMILIES)
def test_batch_of_rows_with_different_image_counts(folder, padding_side):
    processor, model = load(folder)
    image_id = processor.tokenizer.convert_tokens_to_ids(FAMILIES[folder][2])
    per_image = FAMILIES[folder][3]
    rows = [(1, "Describe it."), (2, "Which of the two is brighter?")]
    batch = process(processor, rows, padding_side)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert [int((r == image_id).sum()) for r in ids] == [per_image, 2 * per_image]
    pad_at = 0 if padding_side == "left" else -1
    assert mask[0, pad_at] == 0 and mask[1].all()
    with torch.no_grad():
        logits = model(**batch).logits
    assert torch.isfinite(logits).all()
    out = model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert out.shape[0] == 2


def test_rebuild_is_byte_identical(tmp_path):
    build_vlm_assets.build(tmp_path, list(FAMILIES))
    for folder in FAMILIES:
        shipped, rebuilt = ASSETS / "models" / folder, tmp_path / folder
        names = sorted(p.name for p in shipped.iterdir())
        assert names == sorted(p.name for p in rebuilt.iterdir())
        match, mismatch, errors = filecmp.cmpfiles(shipped, rebuilt, names, shallow=False)
        assert not mismatch and not errors, (folder, mismatch, errors)
