"""SFT on a vision-language model: rows with images checked at setup naming the row, batches processed per row equal
to the processor's own batch of those rows (what TRL's vision collator builds), labels never on image tokens, the
image inputs reaching the forward, the freeze knobs, training through the Python API and the console script, and
the export (model + processor) reloading to the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from helpers import console_script  # noqa: E402

QWEN = "assets/models/tiny-qwen2-vl"


def _image(path: Path, colour, size=(56, 56)) -> str:
    Image.new("RGB", size, colour).save(path)
    return path.name


def _rows(folder: Path) -> list[dict]:
    """Three conversations: image parts with two images, a string turn with one image (placeholders inserted as
    TRL's ``prepare_multimodal_messages`` does), and one with no image."""
    a, b, c = (_image(folder / f"{n}.png", col, size) for n, col, size in
               (("a", (250, 10, 10), (56, 56)), ("b", (10, 250, 10), (84, 56)), ("c", (10, 10, 250), (56, 84))))
    return [
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                   {"type": "text", "text": "which is red?"}]},
                      {"role": "assistant", "content": "the first"}], "images": [a, b]},
        {"messages": [{"role": "user", "content": "what colour?"}, {"role": "assistant", "content": "blue"}],
         "images": [c]},
        {"messages": [{"role": "user", "content": "no picture"}, {"role": "assistant", "content": "fine"}],
         "images": []},
    ]


def _write(folder: Path, rows: list[dict], name: str = "data.jsonl") -> Path:
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _datamodule(repo, path, **kwargs):
    from lightalign import SFTDataModule

    dm = SFTDataModule(str(path), str(repo / QWEN), batch_size=3, **kwargs)
    dm.setup("fit")
    return dm


@pytest.fixture(scope="module")
def conversations(repo, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm_sft")
    return folder, _write(folder, _rows(folder))


def _trl_batch(processor, rows: list[dict], folder: Path, assistant_only: bool):
    """What TRL 1.16's vision collator builds for these rows (``_collate_language_modeling``): images into the parts,
    one ``apply_chat_template`` over the batch, right padding, no special tokens added."""
    from lightalign.vision import with_image_parts

    messages = []
    for row in rows:
        images = [Image.open(folder / name).convert("RGB") for name in row["images"]]
        msgs, it = with_image_parts(row["messages"], len(images), where="test"), iter(images)
        messages.append([{**m, "content": [{**p, "image": next(it)} if p.get("type") == "image" else p
                                           for p in m["content"]]} if isinstance(m["content"], list) else m
                         for m in msgs])
    out = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                        return_assistant_tokens_mask=assistant_only,
                                        processor_kwargs={"padding": True, "padding_side": "right",
                                                          "add_special_tokens": False})
    labels = out["input_ids"].clone()
    labels[out["attention_mask"] == 0] = -100
    if assistant_only:
        labels[out["assistant_masks"] == 0] = -100
    return out, labels


@pytest.mark.parametrize("assistant_only", [True, False])
def test_per_row_batch_equals_the_processors_batch_and_image_tokens_are_never_targets(repo, conversations,
                                                                                      assistant_only):
    """Mutations: ``ImageInputs.tensors`` dropping a row -> pixel values differ; the image-token mask removed from
    ``encode_sft_row`` -> the image tokens carry labels (full-sequence loss, as TRL trains them) and the check fails;
    the assistant mask ignored -> labels differ from TRL's."""
    folder, path = conversations
    dm = _datamodule(repo, path, assistant_only_loss=assistant_only, max_length=None)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    batch = dm.collate_fn()([dm.train_dataset[i] for i in range(3)])
    ref, ref_labels = _trl_batch(dm.processor, rows, folder, assistant_only)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        torch.testing.assert_close(batch[key], ref[key], rtol=0, atol=0, msg=key)
    images = batch["image_inputs"].tensors()
    assert batch["image_inputs"].images_per_row == [2, 1, 0]
    for key in ("pixel_values", "image_grid_thw"):
        torch.testing.assert_close(images[key], ref[key], rtol=0, atol=0, msg=key)
    on_image = batch["input_ids"] == dm.processor.image_token_id
    assert on_image.sum() > 0 and (batch["labels"][on_image] == -100).all()
    expected = ref_labels.masked_fill(on_image, -100)  # TRL trains on image tokens without assistant_only_loss
    torch.testing.assert_close(batch["labels"], expected, rtol=0, atol=0)
    if assistant_only:
        assert dm.tokenizer.decode(batch["labels"][1][batch["labels"][1] != -100]) == "blue<|im_end|>"


@pytest.mark.parametrize("case", ["messages", "messages_assistant_only", "prompt_completion"])
def test_batches_equal_trls_vision_collator(repo, tmp_path, case):
    """TRL 1.16's ``DataCollatorForVisionLanguageModeling`` on three demo rows (one with two images), saved by
    bench/trl_parity/sft_vlm.py: our per-row batch has its tokens, masks, ``mm_token_type_ids``, image grid and pixels,
    and its labels except on image tokens (TRL trains them when the whole sequence is the target; we never do).
    Mutations: the completion's ``mm_token_type_ids`` not zero-padded, the assistant mask ignored, or the image-token
    mask removed -> a tensor differs."""
    fixture = torch.load(repo / "tests/fixtures/trl_sft_vlm_parity.pt", weights_only=True)[case]
    rows, kwargs, ref = json.loads(fixture["rows"]), json.loads(fixture["kwargs"]), fixture["batch"]
    data = _write(tmp_path, [{**r, "images": [str(repo / "examples/data" / p) for p in r["images"]]} for r in rows])
    dm = _datamodule(repo, data, max_length=None, **kwargs)
    batch = dm.collate_fn()([dm.train_dataset[i] for i in range(len(rows))])
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        torch.testing.assert_close(batch[key], ref[key], rtol=0, atol=0, msg=key)
    images = batch["image_inputs"].tensors()
    torch.testing.assert_close(images["image_grid_thw"], ref["image_grid_thw"], rtol=0, atol=0)
    pixels = images["pixel_values"].double()
    stats = torch.tensor([*pixels.shape, pixels.sum(), (pixels ** 2).sum()], dtype=torch.float64)
    torch.testing.assert_close(stats, ref["pixel_values_stats"], rtol=1e-9, atol=0)
    on_image = batch["input_ids"] == dm.processor.image_token_id
    torch.testing.assert_close(batch["labels"], ref["labels"].masked_fill(on_image, -100), rtol=0, atol=0)
    assert (ref["labels"][on_image] != -100).any() == (case == "messages")  # where TRL trains on image tokens


def test_prompt_completion_and_text_rows(repo, tmp_path):
    """Prompt-completion: loss on the completion only (``completion_only_loss``), the prompt processed with its
    images, the completion after it; ``text`` rows with the processor's image token. Mutation: the completion's
    ``mm_token_type_ids`` not padded with zeros -> lengths differ from ``input_ids``."""
    name = _image(tmp_path / "a.png", (200, 0, 0))
    pc = _write(tmp_path, [{"prompt": [{"role": "user", "content": "colour?"}],
                            "completion": [{"role": "assistant", "content": "red"}], "images": [name]}], "pc.jsonl")
    dm = _datamodule(repo, pc, max_length=None)
    batch = dm.collate_fn()([dm.train_dataset[0]])
    assert batch["mm_token_type_ids"].shape == batch["input_ids"].shape
    assert dm.tokenizer.decode(batch["labels"][0][batch["labels"][0] != -100]) == "red<|im_end|>\n"
    prompt = dm.processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                            {"type": "text", "text": "colour?"}]}],
                                              tokenize=False, add_generation_prompt=True)
    ref = dm.processor(text=[prompt], images=[[Image.open(tmp_path / name)]], return_tensors="pt")
    n = ref["input_ids"].shape[1]
    assert batch["input_ids"][0, :n].tolist() == ref["input_ids"][0].tolist()
    torch.testing.assert_close(batch["image_inputs"].tensors()["pixel_values"], ref["pixel_values"], rtol=0, atol=0)
    text = _write(tmp_path, [{"text": "look <|vision_start|><|image_pad|><|vision_end|> red", "images": [name]}],
                  "text.jsonl")
    dm = _datamodule(repo, text, max_length=None)
    batch = dm.collate_fn()([dm.train_dataset[0]])
    on_image = batch["input_ids"][0] == dm.processor.image_token_id
    assert on_image.sum() == 4 and (batch["labels"][0][on_image] == -100).all()
    assert (batch["labels"][0][~on_image] != -100).all()


def test_bad_rows_are_refused_at_setup_naming_the_row(repo, tmp_path):
    from lightalign import SFTDataModule
    from lightalign.datamodules.formats import DataFormatError

    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "images": [_image(tmp_path / "a.png", (1, 2, 3))]}
    cases = [
        ({**good, "images": ["missing.png"]}, r"train row 1, column 'images'\[0\]: the image 'missing.png' does not "
                                              "exist"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                    {"type": "text", "text": "q"}]},
                       {"role": "assistant", "content": "a"}], "images": ["a.png"]},
         r"train row 1: the conversation has 2 image placeholder\(s\).*row has 1 image"),
        ({"text": "no placeholder here", "images": ["a.png"]}, r"train row 1: the text holds 0 image placeholder"),
    ]
    for bad, message in cases:
        rows = [good, bad] if "messages" in bad else [{"text": "<|image_pad|> x", "images": ["a.png"]}, bad]
        path = _write(tmp_path, rows)
        with pytest.raises(DataFormatError, match=message):
            _datamodule(repo, path)
    path = _write(tmp_path, [good])
    with pytest.raises(DataFormatError, match=r"image column 'images', and '.*assets/models/tiny' is a text-only"):
        SFTDataModule(str(path), str(repo / "assets/models/tiny")).setup("fit")
    from lightalign.modules.adaptations import LayoutRefused

    for knob in ("packing", "padding_free"):  # measured on the model (refuse_image_layout): Qwen's 1-D positions
        with pytest.raises(LayoutRefused, match=rf"data.{knob} .*cannot run exactly with images on "
                                                r"Qwen2VLForConditionalGeneration.*nats.*Set data.padding_free: false"
                                                if knob == "padding_free" else
                                                r"data.packing \(SFTDataModule\) cannot run exactly with images on "
                                                r"Qwen2VLForConditionalGeneration.*nats.*Set data.packing: false"):
            _datamodule(repo, path, **{knob: True})
    for knob, value in (("group_by_length", True), ("truncation_mode", "keep_end")):
        with pytest.raises(DataFormatError, match=f"{knob} is not supported for SFT data with images"):
            _datamodule(repo, path, **{knob: value})


def test_max_length_never_cuts_inside_an_image(repo, conversations):
    """Row 0's image tokens end at token 32 (of 50): ``max_length=20`` is refused naming the row; ``max_length=40`` cuts the
    text after them. Mutation: the check removed -> the cut batch is returned."""
    _, path = conversations
    dm = _datamodule(repo, path, max_length=20)
    with pytest.raises(ValueError, match=r"row 0: its image tokens reach token \d+ .* past max_length=20"):
        dm.collate_fn()([dm.train_dataset[0]])
    dm = _datamodule(repo, path, max_length=40)
    batch = dm.collate_fn()([dm.train_dataset[0]])
    assert batch["input_ids"].shape[1] == 40 and batch["mm_token_type_ids"].shape[1] == 40


@pytest.fixture(scope="module")
def fitted(repo, conversations, tmp_path_factory):
    """Two SFT steps on the tiny Qwen2-VL through the Python API (``lightalign.Trainer``: its export included)."""
    import os

    import lightning as L

    from lightalign import SFTDataModule, SFTModule, Trainer

    _, path = conversations
    L.seed_everything(0)
    dm = SFTDataModule(str(path), str(repo / QWEN), batch_size=2, max_length=None)
    module = SFTModule(model_name_or_path=str(repo / QWEN), from_config=True, learning_rate=1e-3)
    run = tmp_path_factory.mktemp("fit")
    cwd = os.getcwd()
    os.chdir(run)
    try:
        trainer = Trainer(max_steps=2, accelerator="cpu", enable_progress_bar=False, enable_checkpointing=False)
        trainer.fit(module, dm)
    finally:
        os.chdir(cwd)
    return module, dm, run / trainer.run_dir / "hf_model"  # (run_dir is relative to the run's working directory)


def test_sft_trains_and_the_export_reloads_with_its_processor_to_the_same_logits(fitted):
    """The export: ``AutoModelForImageTextToText`` + the processor (``processor_config.json`` naming
    ``Qwen2VLProcessor``), the card naming both; the reloaded model gives the trained model's logits on a batch with
    images. Mutations: ``sft_logits`` without ``model_inputs(batch)`` -> the image tokens have no features and the
    forward fails; ``HFExport`` saving the tokenizer only -> no processor_config.json."""
    from transformers import AutoModelForImageTextToText

    from lightalign.modules.training.sft_forward import sft_logits
    from lightalign.vision import load_processor

    module, dm, export = fitted
    assert module.trainer.global_step == 2 and module.is_vision_language
    assert json.loads((export / "processor_config.json").read_text())["processor_class"] == "Qwen2VLProcessor"
    card = (export / "README.md").read_text()
    assert "vision-language model" in card and "AutoModelForImageTextToText.from_pretrained(folder)" in card
    assert "processor = AutoProcessor.from_pretrained(folder)" in card and "pipeline_tag: image-text-to-text" in card
    processor = load_processor(str(export))
    assert type(processor).__name__ == "Qwen2VLProcessor" and processor.chat_template == dm.processor.chat_template
    reloaded = AutoModelForImageTextToText.from_pretrained(export).eval()
    batch = dm.collate_fn()([dm.train_dataset[i] for i in range(2)])
    module.model.eval()
    with torch.no_grad():
        ours, theirs = sft_logits(module.model, batch), sft_logits(reloaded, batch)
        plain = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         **batch["image_inputs"].tensors(), mm_token_type_ids=batch["mm_token_type_ids"]).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)
    torch.testing.assert_close(plain, ours, rtol=0, atol=0)


def test_sft_forward_uses_the_images(repo, conversations):
    """Other pixels, other logits at the answer. Mutation: ``sft_logits`` dropping ``model_inputs`` -> the forward
    raises (image tokens without features) or the logits do not move."""
    from lightalign.hub import load_causal_lm
    from lightalign.modules.training.sft_forward import sft_logits
    from lightalign.vision import ImageInputs

    _, path = conversations
    dm = _datamodule(repo, path, max_length=None)
    batch = dm.collate_fn()([dm.train_dataset[1]])
    torch.manual_seed(0)
    model = load_causal_lm(str(repo / QWEN), from_config=True).eval()
    row = batch["image_inputs"].rows[0]
    other = ImageInputs(({**row, "pixel_values": -row["pixel_values"]},), batch["image_inputs"].layout)
    with torch.no_grad():
        logits = sft_logits(model, batch)
        moved = sft_logits(model, {**batch, "image_inputs": other})
    assert (logits[0, -1] - moved[0, -1]).abs().max() > 1e-4


def test_freeze_knobs_freeze_exactly_the_vision_parameters(repo):
    """``freeze_vision_tower`` freezes ``model.visual`` except Qwen's ``merger`` (the projector), which
    ``freeze_multi_modal_projector`` freezes; with LoRA both keep adapters out of the vision half; a text model
    refuses the knobs. Mutation: ``freeze_vision`` freezing nothing -> the requires_grad checks fail."""
    pytest.importorskip("peft")
    from lightalign import SFTModule

    name = str(repo / QWEN)
    tower = SFTModule(model_name_or_path=name, from_config=True, freeze_vision_tower=True)
    tower.configure_model()
    params = dict(tower.model.named_parameters())
    frozen = {n for n, p in params.items() if not p.requires_grad}
    assert frozen == {n for n in params if n.startswith("model.visual.") and ".merger." not in n} and frozen
    both = SFTModule(model_name_or_path=name, from_config=True, freeze_vision_tower=True,
                     freeze_multi_modal_projector=True)
    both.configure_model()
    frozen = {n for n, p in both.model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n in params if n.startswith("model.visual.")}
    lora = SFTModule(model_name_or_path=name, from_config=True, freeze_vision_tower=True,
                     freeze_multi_modal_projector=True,
                     peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    lora.configure_model()
    adapters = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n and ".language_model." in n for n in adapters)
    with pytest.raises(ValueError, match="freeze_vision_tower apply to a vision-language model, and .* is a text-only"):
        SFTModule(model_name_or_path=str(repo / "assets/models/tiny"), from_config=True, freeze_vision_tower=True)


def test_vision_parts_are_found_in_each_family(repo):
    """The tower and projector names of the shipped families (built on the meta device: no weights)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from lightalign.modules.training.vision_model import vision_parts

    expected = {"tiny-qwen2-vl": (["model.visual"], ["model.visual.merger"]),
                "tiny-qwen3-vl": (["model.visual"], ["model.visual.merger", "model.visual.deepstack_merger_list"]),
                "tiny-gemma3": (["model.vision_tower"], ["model.multi_modal_projector"]),
                "tiny-smolvlm": (["model.vision_model"], ["model.connector"]),
                "tiny-llava": (["model.vision_tower"], ["model.multi_modal_projector"])}
    for folder, parts in expected.items():
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(repo / "assets/models" / folder))
        assert vision_parts(model) == parts, folder


def test_console_script_fits_the_shipped_config(repo, tmp_path):
    out = console_script.run(repo, "fit", "--config", "configs/vlm_sft_tiny.yaml", "--trainer.max_steps", "2",
                             "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2",
                             "--trainer.logger.init_args.save_dir", str(tmp_path), "--data.batch_size", "2",
                             timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    export = next(tmp_path.rglob("hf_model"))
    assert (export / "processor_config.json").is_file() and (export / "model.safetensors").is_file()
    metrics = (next(tmp_path.rglob("metrics.csv"))).read_text()
    assert "val/loss" in metrics and "train/loss" in metrics


def test_the_card_of_a_vision_language_adapter_loads_its_base_with_the_image_text_class():
    """peft's ``AutoPeftModelForCausalLM`` would build the base with ``AutoModelForCausalLM`` (no class for most VLMs):
    the snippet builds it with ``AutoModelForImageTextToText`` and puts the adapter on it."""
    from lightalign.modules.training.model_card import model_card_text

    common = dict(method="SFTModule", base_model="Qwen/Qwen2-VL-2B-Instruct", hparams={}, defaults={}, metrics={},
                  versions={}, folder="/x/hf_model", vision_language=True)
    adapter = model_card_text(**common, library_name="peft", auto_class="AutoPeftModelForCausalLM")
    assert ('base = AutoModelForImageTextToText.from_pretrained("Qwen/Qwen2-VL-2B-Instruct")\n'
            "model = PeftModel.from_pretrained(base, folder)\nprocessor = AutoProcessor.from_pretrained(folder)") in adapter
    full = model_card_text(**common, auto_class="AutoModelForImageTextToText", pipeline_tag="image-text-to-text")
    assert "from transformers import AutoModelForImageTextToText, AutoProcessor" in full and "vision-language" in full
