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


# A system turn, a user turn with an image part, an answer, a user turn of plain string content: each family's layout.
RENDERED = {
    "tiny-qwen2-vl": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|>"
                     "<|vision_end|>Count?<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n<|im_start|>user\n"
                     "And now?<|im_end|>\n<|im_start|>assistant\n",
    "tiny-gemma3": "<bos><start_of_turn>user\nBe brief.\n\n<start_of_image>Count?<end_of_turn>\n<start_of_turn>model\n"
                   "3<end_of_turn>\n<start_of_turn>user\nAnd now?<end_of_turn>\n<start_of_turn>model\n",
    "tiny-smolvlm": "<|im_start|>System: Be brief.<end_of_utterance>\nUser:<image>Count?<end_of_utterance>\n"
                    "Assistant: 3<end_of_utterance>\nUser: And now?<end_of_utterance>\nAssistant:",
    "tiny-llava": "Be brief. USER: <image>\nCount? ASSISTANT: 3</s>USER: And now? ASSISTANT:",
}
RENDERED["tiny-qwen2.5-vl"] = RENDERED["tiny-qwen3-vl"] = RENDERED["tiny-qwen2-vl"]
# The end of an assistant turn (inside the assistant mask with its answer).
END_OF_TURN = {"tiny-gemma3": "<end_of_turn>", "tiny-smolvlm": "<end_of_utterance>", "tiny-llava": "</s>"}

# Processor outputs a forward cannot do without (beyond input_ids / attention_mask): dropping one raises or changes
# the logits. Not listed: Idefics3's pixel_attention_mask (every image is resized to the full square here: all ones).
NEEDED = {
    "tiny-qwen2-vl": ("pixel_values", "image_grid_thw", "mm_token_type_ids"),
    "tiny-qwen2.5-vl": ("pixel_values", "image_grid_thw", "mm_token_type_ids"),
    "tiny-qwen3-vl": ("pixel_values", "image_grid_thw", "mm_token_type_ids"),
    "tiny-gemma3": ("pixel_values", "token_type_ids"),
    "tiny-smolvlm": ("pixel_values",),
    "tiny-llava": ("pixel_values",),
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


def process(processor, rows: list[tuple[int, str]], padding_side: str = "right", first_row: int = 0):
    """One processor call over rows of (number of images, question), images 56x56, each row its own images (seeded
    by the row's index counted from ``first_row``)."""
    processor.tokenizer.padding_side = padding_side
    texts = [processor.apply_chat_template(conversation(n, q), add_generation_prompt=True, tokenize=False)
             for n, q in rows]
    images = [[image(10 * (first_row + r) + i) for i in range(n)] for r, (n, _) in enumerate(rows)]
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
    """Rows of 1 and 2 images padded together: each row's logits are its logits alone (images go to their rows)."""
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
        for r, row in enumerate(rows):
            expected = model(**process(processor, [row], padding_side, first_row=r)).logits[0]
            # Float32 sums in another order (batched matmuls): far below the logits' spread (~0.1).
            assert (logits[r][mask[r].bool()] - expected).abs().max() < 1e-5
    out = model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert out.shape[0] == 2


@pytest.mark.parametrize("folder", FAMILIES)
def test_chat_template_renders_the_family_layout(folder):
    processor, _ = load(folder)
    messages = [{"role": "system", "content": "Be brief."}, *conversation(1, "Count?", "3"),
                {"role": "user", "content": "And now?"}]
    assert processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == RENDERED[folder]
    # The answer and the end of its turn, and nothing else, are the assistant's tokens.
    messages = conversation(1, "Count?", "3")
    messages[0]["content"][0] = {"type": "image", "image": image(5)}
    out = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    answer = [i for i, m in zip(out["input_ids"][0], out["assistant_masks"][0]) if m]
    assert processor.tokenizer.decode(answer) == "3" + END_OF_TURN.get(folder, "<|im_end|>")
    # The base tokenizer's text tokenisation is unchanged by the added special tokens.
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(ASSETS / "models" / "tiny")
    assert processor.tokenizer.encode("12+7=19 hello") == base.encode("12+7=19 hello")


@pytest.mark.parametrize("folder", FAMILIES)
def test_forward_needs_the_family_image_inputs(folder):
    processor, model = load(folder)
    batch = process(processor, [(1, "Describe it."), (2, "Which of the two is brighter?")], "left")
    real = batch["attention_mask"].bool()
    extra = set(batch) - {"input_ids", "attention_mask"}
    assert set(NEEDED[folder]) <= extra and extra - set(NEEDED[folder]) <= {"pixel_attention_mask"}
    with torch.no_grad():
        logits = model(**batch).logits
        for key in NEEDED[folder]:
            try:
                dropped = model(**{k: v for k, v in batch.items() if k != key}).logits
            except (ValueError, AttributeError, TypeError):
                continue  # refused (Qwen2-VL / Qwen3-VL without mm_token_type_ids; every Qwen without the grid)
            assert (dropped[real] - logits[real]).abs().max() > 1e-4, key


@pytest.mark.parametrize("folder", [f for f in FAMILIES if "qwen" in f])
def test_qwen_multimodal_positions_from_get_rope_index(folder):
    """Qwen's forward computes its (time, height, width) positions itself; the same ones passed as ``position_ids``
    give the same logits, and they are not 1-D positions: an image of 2x2 tokens advances the text position by 2."""
    processor, model = load(folder)
    batch = process(processor, [(1, "Describe it."), (2, "Which of the two is brighter?")], "left")
    real = batch["attention_mask"].bool()
    positions, rope_deltas = model.model.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], image_grid_thw=batch["image_grid_thw"],
        attention_mask=batch["attention_mask"])
    assert positions.shape == (3, *batch["input_ids"].shape)
    assert rope_deltas.view(-1).tolist() == [-2, -4]  # each 4-token image takes 2 positions
    with torch.no_grad():
        logits = model(**batch).logits
        given = model(**batch, position_ids=positions).logits
        flat = model(**batch, position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)).logits
    assert (given[real] - logits[real]).abs().max() < 1e-5
    assert (flat[real] - logits[real]).abs().max() > 1e-4


def test_rebuild_is_byte_identical(tmp_path):
    build_vlm_assets.build(tmp_path, list(FAMILIES))
    for folder in FAMILIES:
        shipped, rebuilt = ASSETS / "models" / folder, tmp_path / folder
        names = sorted(p.name for p in shipped.iterdir())
        assert names == sorted(p.name for p in rebuilt.iterdir())
        match, mismatch, errors = filecmp.cmpfiles(shipped, rebuilt, names, shallow=False)
        assert not mismatch and not errors, (folder, mismatch, errors)
