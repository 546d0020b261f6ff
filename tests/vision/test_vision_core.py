"""The vision core: a row's images and placeholders checked with errors naming the row, the processor loaded
image-only without torchvision, the batch layout of its outputs measured, and ``ImageInputs`` rebuilding exactly the
processor's batch from rows processed alone, whatever the row order."""

from __future__ import annotations

import io

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from helpers.vlm_folders import build_tiny_qwen2_vl  # noqa: E402
from lightalign.vision.messages import as_content_parts  # noqa: E402
from lightalign.vision import (ImageInputs, encode_row, is_vision_language_model, load_image, load_processor,  # noqa: E402
                               measure_key_layout, model_inputs, row_images, with_image_parts)

@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory, repo):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"), repo)


def _images():
    return [Image.new("RGB", (56, 56), (250, 10, 10)), Image.new("RGB", (84, 56), (10, 250, 10)),
            Image.new("RGB", (56, 84), (10, 10, 250))]


def _text(processor, count, question="how many?"):
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in range(count)),
                                              {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_images_open_from_each_format_and_bad_ones_name_the_row(tmp_path):
    img = Image.new("RGBA", (8, 8), (1, 2, 3, 4))
    img.save(tmp_path / "a.png")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    for value in ("a.png", str(tmp_path / "a.png"), {"bytes": buf.getvalue(), "path": None}, img):
        out = load_image(value, where="train row 3", base_dir=tmp_path)
        assert out.mode == "RGB" and out.size == (8, 8)
    assert len(row_images({"image": "a.png"}, where="r", base_dir=tmp_path)) == 1
    assert len(row_images({"images": ["a.png", "a.png"]}, where="r", base_dir=tmp_path)) == 2
    with pytest.raises(ValueError, match=r"train row 3, column 'images'\[1\]: the image 'missing.png' does not exist"):
        row_images({"images": ["a.png", "missing.png"]}, where="train row 3", base_dir=tmp_path)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="row 5.*'bad.png' cannot be opened"):
        load_image("bad.png", where="row 5", base_dir=tmp_path)
    with pytest.raises(ValueError, match="row 6: an image must be"):
        load_image(3, where="row 6")


def test_placeholders_inserted_for_string_turns_and_counted_for_parts():
    plain = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    out = with_image_parts(plain, 2, where="row 1")
    assert out[1]["content"][:2] == [{"type": "image"}, {"type": "image"}] and out[0] == plain[0]
    assert with_image_parts(plain, 0, where="row 1") is plain
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}]
    assert with_image_parts(parts, 1, where="row 1") is parts
    with pytest.raises(ValueError, match=r"row 7: the conversation has 1 image placeholder.*row has 2 image"):
        with_image_parts(parts, 2, where="row 7")
    with pytest.raises(ValueError, match=r"row 8: the conversation has 1 .* has 0"):
        with_image_parts(parts, 0, where="row 8")
    # TRL's rule: the first user turn with string content takes the images, whatever the other turns hold
    mixed = [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]
    assert with_image_parts(mixed, 1, where="row 9")[0]["content"] == [{"type": "image"}, {"type": "text", "text": "q"}]
    assert as_content_parts(mixed, 1) == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}, mixed[1]]
    assert as_content_parts(parts, 1) == parts


def test_processor_loads_image_only_and_its_layout_is_measured(qwen2_vl):
    assert is_vision_language_model(str(qwen2_vl))
    assert not is_vision_language_model("assets/models/tiny")
    processor = load_processor(str(qwen2_vl))
    assert type(processor).__name__ == "Qwen2VLProcessor"
    layout = measure_key_layout(processor)
    assert set(layout.image_keys) == {"pixel_values", "image_grid_thw"} and layout.row_keys == ()
    assert "mm_token_type_ids" in layout.token_keys


def test_image_inputs_rebuild_the_processors_batch_in_any_row_order(qwen2_vl):
    """Rows processed alone, then selected (reordered, repeated) and batched, equal the processor's own batch of
    those rows. Mutation: ``tensors`` concatenating rows in reverse order -> the pixel values differ."""
    processor = load_processor(str(qwen2_vl))
    layout = measure_key_layout(processor)
    imgs = _images()
    rows = [(_text(processor, 2), imgs[:2]), (_text(processor, 1, "colour?"), imgs[2:])]
    encoded = [encode_row(processor, text, images, layout) for text, images in rows]
    inputs = ImageInputs(tuple(e[2] for e in encoded), layout)
    assert inputs.images_per_row == [2, 1]
    for order in ([0, 1], [1, 0, 1]):
        batch = processor(text=[rows[i][0] for i in order], images=[rows[i][1] for i in order], return_tensors="pt",
                          padding=True, padding_side="right", add_special_tokens=False)
        got = inputs.select(order).tensors()
        assert set(got) == {"pixel_values", "image_grid_thw"}
        torch.testing.assert_close(got["pixel_values"], batch["pixel_values"], rtol=0, atol=0)
        torch.testing.assert_close(got["image_grid_thw"], batch["image_grid_thw"], rtol=0, atol=0)
        for i, j in enumerate(order):
            n = len(encoded[j][0])
            assert batch["input_ids"][i, :n].tolist() == encoded[j][0]
            assert batch["mm_token_type_ids"][i, :n].tolist() == encoded[j][1]["mm_token_type_ids"]


def test_model_inputs_reach_the_vlm_forward(qwen2_vl):
    """The logits of a batch built from per-row ``ImageInputs`` equal the processor batch's, and depend on the
    pixels. Mutation: ``model_inputs`` returning no image tensors -> the forward refuses image tokens without
    images (and the pixel check fails)."""
    from lightalign.hub import load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm(str(qwen2_vl), from_config=True).eval()
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    processor = load_processor(str(qwen2_vl))
    layout = measure_key_layout(processor)
    imgs = _images()
    text = _text(processor, 2)
    ids, extras, tensors = encode_row(processor, text, imgs[:2], layout)
    batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
             "image_inputs": ImageInputs((tensors,), layout),
             **{k: torch.tensor([v]) for k, v in extras.items()}}
    with torch.no_grad():
        ours = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     **model_inputs(batch)).logits
        ref = model(**processor(text=[text], images=[imgs[:2]], return_tensors="pt", add_special_tokens=False)).logits
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)
        other = ImageInputs(({**tensors, "pixel_values": tensors["pixel_values"].flip(0)},), layout)
        changed = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        **model_inputs({**batch, "image_inputs": other})).logits
    assert (changed[0, -1] - ours[0, -1]).abs().max() > 1e-4


def test_methods_not_measured_with_images_refuse_image_data_at_setup(tiny_dir):
    """Image rows reaching a method whose forwards do not read them (ORPO, TPO, reward modelling, PPO ...) are
    refused at setup naming the methods that take them (``PolicyModule.refuse_unmeasured_images``); text data and
    the measured methods pass. Mutation: ``takes_images = True`` on ``PolicyModule`` -> ORPO is not refused."""
    from types import SimpleNamespace

    from lightalign import DPOModule, ORPOModule, PPOModule, RewardModule, TPOModule

    for cls in (ORPOModule, TPOModule, RewardModule, PPOModule):
        module = cls.__new__(cls)
        module._trainer = SimpleNamespace(datamodule=SimpleNamespace(has_images=True))
        with pytest.raises(ValueError, match=rf"{cls.__name__} is not measured on rows with images.*DPOModule.*"
                                             r"GRPOModule.*SFTModule"):
            module.refuse_unmeasured_images()
        module._trainer = SimpleNamespace(datamodule=SimpleNamespace(has_images=False))
        module.refuse_unmeasured_images()
    module = DPOModule.__new__(DPOModule)
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(has_images=False))
    module.refuse_unmeasured_images()


@pytest.mark.parametrize("folder, layout, found", [
    ("tiny-qwen2-vl", "dpo_shared", r"data.prompt_sharing .*cannot run exactly with images on "
                                    r"Qwen2VLForConditionalGeneration.*differ .* by up to .* nats"),
    ("tiny-llava", "padding_free", r"with image rows: LlavaForConditionalGeneration \(model_type 'llava'\) can run "
                                   r"the padding_free layout exactly with images \(measured on a shrunk copy: at most "
                                   r".* nats from each sequence alone\), but Stand does not build padding_free rows "
                                   r"with images yet"),
])
def test_a_layout_other_than_padded_rows_is_refused_with_its_measurement(repo, folder, layout, found):
    """A method that takes images refuses a non-padded layout at setup with what the probe measured on the user's
    model (``refuse_image_layout``): the difference where the model cannot run it, else that it is not built.
    Mutation: ``refuse_unmeasured_images`` returning for every method that takes images -> nothing is refused."""
    from types import SimpleNamespace

    from lightalign import DPOModule
    from lightalign.modules.adaptations import LayoutRefused

    class Stand(DPOModule):
        def batch_layout(self):
            return self.layout, None

    name = str(repo / "assets/models" / folder)
    module = Stand.__new__(Stand)
    module.layout, module.model, module.model_name_or_path = "dpo_classic", None, name
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(has_images=True, processor=load_processor(name)))
    module.knobs = SimpleNamespace(model=SimpleNamespace(model=None))
    module.refuse_unmeasured_images()  # padded pairs: measured exact, taken
    module.layout = layout
    with pytest.raises(LayoutRefused, match=found):
        module.refuse_unmeasured_images()


def test_without_pillow_the_vision_extra_is_named_before_any_row_is_read(monkeypatch, tmp_path):
    """Mutation: ``require_pillow`` doing nothing -> transformers' error (torchvision first) or PIL's ImportError."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "PIL" else real(name, *a))
    with pytest.raises(ImportError, match=r"need Pillow: pip install 'lightalign\[vision\]'"):
        load_image("a.png", where="row 0", base_dir=tmp_path)
    with pytest.raises(ImportError, match=r"lightalign\[vision\]"):
        load_processor(str(tmp_path))
