"""DPO and KTO with images on the shipped tiny Qwen2-VL: the collators' batches equal the processor's own, the DPO loss
equals a hand-built one on those tensors, KTO's mismatched sequences see their own prompts' images, bad rows and
layouts not measured with images are refused at setup naming the row or the knob, and the shipped configs train
through the console script."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from helpers import console_script  # noqa: E402
from lightalign import DPOModule, KTOModule, PreferenceDataModule, UnpairedPreferenceDataModule  # noqa: E402
from lightalign.datamodules.formats import DataFormatError  # noqa: E402
from lightalign.modules.kto import sequence_logps  # noqa: E402
from lightalign.modules.reference.model import images_fingerprint  # noqa: E402
from lightalign.vision import load_processor  # noqa: E402

BETA = 0.1
COLOURS = [(220, 30, 30), (30, 200, 40), (40, 40, 220)]


@pytest.fixture(scope="module")
def qwen(repo):
    return repo / "assets/models/tiny-qwen2-vl"


@pytest.fixture(scope="module")
def processor(qwen):
    return load_processor(str(qwen))


def _model(qwen, seed):
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(qwen)).eval()


def _user(text, images=1):
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(images)), {"type": "text", "text": text}]}]


def _write(folder, rows, sizes=((56, 56), (84, 56), (56, 84))):
    folder.mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(sizes):
        Image.new("RGB", size, COLOURS[i]).save(folder / f"img{i}.png")
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _pairs():
    return [{"prompt": _user("How many shapes?"), "chosen": [{"role": "assistant", "content": "two"}],
             "rejected": [{"role": "assistant", "content": "seven red"}], "images": ["img0.png"]},
            {"prompt": _user("Which colour?"), "chosen": [{"role": "assistant", "content": "green"}],
             "rejected": [{"role": "assistant", "content": "blue"}], "image": "img1.png"},
            {"prompt": _user("Is it tall?"), "chosen": [{"role": "assistant", "content": "yes"}],
             "rejected": [{"role": "assistant", "content": "no it is wide"}], "images": ["img2.png"]}]


def _pair_data(path, processor, **kw):
    dm = PreferenceDataModule(str(path), processor, prompt_sharing=False, batch_size=3, shuffle=False, **kw)
    dm.setup("fit")
    return dm


def _texts(processor, prompt, completion):
    prompt_text = processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    whole = processor.apply_chat_template(prompt + completion, tokenize=False)
    return prompt_text, whole


def _hand_built_batch(processor, rows, images):
    """The processor's own batch of [chosen rows; rejected rows], each prompt's images repeated for both, and the
    completion mask from each prompt's own processed length."""
    prompts = [row["prompt"] for row in rows]
    wholes, prompt_lengths = [], []
    for key in ("chosen", "rejected"):
        for prompt, row, image in zip(prompts, rows, images):
            prompt_text, whole = _texts(processor, prompt, row[key])
            wholes.append(whole)
            prompt_lengths.append(processor(text=[prompt_text], images=[[image]], return_tensors="pt",
                                            add_special_tokens=False)["input_ids"].shape[1])
    batch = processor(text=wholes, images=[[image] for image in images] * 2, padding=True, padding_side="right",
                      return_tensors="pt", add_special_tokens=False)
    completion = batch["attention_mask"].clone()
    for i, n in enumerate(prompt_lengths):
        completion[i, :n] = 0
    return batch, completion


def _logps_by_hand(model, batch, completion):
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits
    per_token = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return (per_token * completion[:, 1:]).sum(-1)


def test_dpo_loss_on_our_batch_equals_the_hand_built_one(tmp_path, qwen, processor):
    """Our collator's batch equals the processor's batch of the [chosen; rejected] rows (ids, masks, pixel values,
    grids, mm_token_type_ids) and DPOModule's loss (policy and a different reference) equals the sigmoid loss by
    hand on it. Mutations: ``completion_token_logps`` without ``**model_inputs(batch)`` (policy and reference both
    lose their images), and ``DPOModule.reference_logps`` passing the batch without ``image_inputs`` (the reference
    alone) -> the loss differs."""
    dm = _pair_data(_write(tmp_path, _pairs()), processor)
    rows = [dm.train_dataset[i] for i in range(3)]
    batch = dm.collate_fn()(rows)
    images = [Image.open(tmp_path / f"img{i}.png").convert("RGB") for i in range(3)]
    expected, completion = _hand_built_batch(processor, _pairs(), images)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        assert torch.equal(batch[key], expected[key]), key
    assert torch.equal(batch["completion_mask"], completion)
    tensors = batch["image_inputs"].tensors()
    assert torch.equal(tensors["pixel_values"], expected["pixel_values"])
    assert torch.equal(tensors["image_grid_thw"], expected["image_grid_thw"])

    policy, reference = _model(qwen, 0), _model(qwen, 1)
    module = DPOModule(model=policy, beta=BETA)
    module.ref_model = reference
    loss = module._step(batch, module.train_stats)
    pol, ref = _logps_by_hand(policy, expected, completion), _logps_by_hand(reference, expected, completion)
    margin = (pol[:3] - ref[:3]) - (pol[3:] - ref[3:])
    by_hand = -torch.nn.functional.logsigmoid(BETA * margin).mean()
    # float32 sums of a few token log-probs on both sides: ~1e-6 each, scaled by beta in the loss
    torch.testing.assert_close(loss.detach(), by_hand, atol=1e-5, rtol=0)
    # the images matter to this loss at this tolerance: the same rows without them give another one
    text_only = {k: v for k, v in batch.items() if k != "image_inputs"}
    with torch.no_grad():
        assert not torch.allclose(module._pair_logps(policy, text_only)[0], pol[:3], atol=1e-4)


@pytest.mark.parametrize("family", ["tiny-gemma3", "tiny-smolvlm"])
def test_other_families_batches_equal_the_processors_own(tmp_path, repo, family):
    """Gemma 3's ``token_type_ids`` (per token: 0 on completions and padding) and SmolVLM's per-row
    ``pixel_values`` / ``pixel_attention_mask`` follow the ``[chosen; rejected]`` rows as the processor batches
    them. Mutation: ``pad_token_extras`` padding with 1 -> Gemma 3's ``token_type_ids`` differ."""
    processor = load_processor(str(repo / "assets/models" / family))
    dm = _pair_data(_write(tmp_path, _pairs()), processor)
    batch = dm.collate_fn()([dm.train_dataset[i] for i in range(3)])
    images = [Image.open(tmp_path / f"img{i}.png").convert("RGB") for i in range(3)]
    expected, completion = _hand_built_batch(processor, _pairs(), images)
    tensors = batch["image_inputs"].tensors()
    assert set(expected) == {"input_ids", "attention_mask"} | set(tensors) | set(dm.image_layout.token_keys)
    for key, value in expected.items():
        assert torch.equal(batch[key] if key in batch else tensors[key], value), key
    assert torch.equal(batch["completion_mask"], completion)


def test_kto_sequences_and_mismatched_sequences_see_their_own_prompts_images(tmp_path, qwen, processor):
    """Each row and its mismatched (KL) sequence = its prompt with its image + the partner's completion, as the
    processor gives that sequence alone. Mutation: the collator giving ``kl_image_inputs`` the partner rows'
    images (``image_inputs.select(partners)``) -> the KL log-probs differ."""
    rows = [{"prompt": _user("How many shapes?"), "completion": [{"role": "assistant", "content": "two"}],
             "label": True, "images": ["img0.png"]},
            {"prompt": _user("Which colour?"), "completion": [{"role": "assistant", "content": "blue green"}],
             "label": False, "images": ["img1.png"]},
            {"prompt": _user("Is it tall?"), "completion": [{"role": "assistant", "content": "yes"}],
             "label": True, "images": ["img2.png"]}]
    # one size for every image: wrong images would then give wrong values, not a shape error
    path = _write(tmp_path, rows, sizes=((56, 56),) * 3)
    dm = UnpairedPreferenceDataModule(str(path), processor, batch_size=3, shuffle=False)
    dm.setup("fit")
    batch = dm.collate_fn()([dm.train_dataset[i] for i in range(3)])
    model = _model(qwen, 0)
    with torch.no_grad():
        got, got_kl = sequence_logps(model, batch), sequence_logps(model, batch, "kl_")
    partners = [2, 0, 1]  # kl_partners(3, 3): each completion moved one place down the block
    for i, row in enumerate(rows):
        image = Image.open(tmp_path / f"img{i}.png").convert("RGB")
        for completion, value in ((row["completion"], got[i]), (rows[partners[i]]["completion"], got_kl[i])):
            prompt_text, whole = _texts(processor, row["prompt"], completion)
            alone = processor(text=[whole], images=[[image]], return_tensors="pt", add_special_tokens=False)
            n = processor(text=[prompt_text], images=[[image]], return_tensors="pt",
                          add_special_tokens=False)["input_ids"].shape[1]
            mask = alone["attention_mask"].clone()
            mask[:, :n] = 0
            torch.testing.assert_close(value, _logps_by_hand(model, alone, mask)[0], atol=1e-5, rtol=1e-5)


def test_bad_rows_and_unmeasured_layouts_are_refused_at_setup(tmp_path, processor, repo):
    """Each bad row is refused before any model loads, naming the row (and column); the shared prompt and the
    padding-free rows are refused naming the knob; images given to a text model are refused naming the column."""
    good = _pairs()[0]
    parts = dict(good, chosen=[{"role": "assistant", "content": [{"type": "text", "text": "two"}]}])
    cases = [
        ([good, dict(good, images=["missing.png"])],
         r"row 1, column 'images'\[0\]: the image 'missing.png' does not exist"),
        ([good, dict(good, images=["img0.png", "img1.png"])], "row 1: the conversation has 1 image placeholder"),
        ([parts, dict(good, chosen=[{"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}])],
         "row 1, column 'chosen': the completion holds 1 image part"),
        ([dict(good, prompt="Hi", chosen="a", rejected="b", images=[]),
          dict(good, prompt="How many?", chosen="two", rejected="three")], "row 1: the row has 1 image.* string prompt"),
    ]
    for i, (rows, message) in enumerate(cases):
        with pytest.raises(DataFormatError, match=message):
            _pair_data(_write(tmp_path / f"case{i}", rows), processor)
    # string contents get their image parts where TRL puts them (the first user turn)
    plain = [dict(good, prompt=[{"role": "user", "content": "How many shapes?"}])]
    text = _pair_data(_write(tmp_path / "plain", plain), processor).train_dataset[0]["prompt_text"]
    assert text == _texts(processor, good["prompt"], good["chosen"])[0]
    # a prompt longer than max_prompt_length with its image expanded: refused, never cut
    with pytest.raises(DataFormatError, match=r"row 0: its prompt has \d+ tokens with its images' tokens expanded"):
        _pair_data(_write(tmp_path / "long", [good]), processor, max_prompt_length=20)
    path = _write(tmp_path / "ok", [good])
    with pytest.raises(DataFormatError, match="'images' column with images.*is a text model"):
        PreferenceDataModule(str(path), str(repo / "assets/models/tiny"), prompt_sharing=False).setup("fit")
    kto = [{"prompt": _user("q"), "completion": [{"role": "assistant", "content": "a"}], "label": True,
            "images": ["img0.png"]},
           {"prompt": _user("q", images=2), "completion": [{"role": "assistant", "content": "b"}], "label": False,
            "images": ["img1.png"]}]
    with pytest.raises(DataFormatError, match="row 1: the conversation has 2 image placeholder"):
        UnpairedPreferenceDataModule(str(_write(tmp_path / "kto", kto)), processor, batch_size=2).setup("fit")


def test_reference_cache_key_follows_the_image_bytes(tmp_path, processor):
    """Two images of one size expand to the same tokens: the precomputed reference log-prob key must see the bytes.
    Mutation: ``images_fingerprint`` hashing the stored paths instead of the bytes -> equal keys."""
    path = _write(tmp_path, [_pairs()[0]])
    first = images_fingerprint(_pair_data(path, processor).train_dataset)
    Image.new("RGB", (56, 56), (1, 2, 3)).save(tmp_path / "img0.png")
    second = _pair_data(path, processor).train_dataset
    assert second[0]["prompt_input_ids"] == _pair_data(path, processor).train_dataset[0]["prompt_input_ids"]
    assert images_fingerprint(second) != first


@pytest.mark.slow
@pytest.mark.parametrize("config, extra", [("configs/vlm_dpo_tiny.yaml", ()),
                                           ("configs/vlm_kto_tiny.yaml", ("--model.precompute_ref_log_probs", "true"))])
def test_shipped_configs_train_two_steps_through_the_console_script(repo, tmp_path, config, extra):
    """The shipped VLM DPO and KTO configs (KTO with the precomputed reference pass over image rows) train two
    steps through ``lightalign fit``."""
    if extra:
        extra = (*extra, "--model.ref_log_probs_cache_dir", str(tmp_path / "cache"))
    proc = console_script.run(repo, "fit", "--config", config, "--trainer.max_steps", "2",
                              "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
                              "--trainer.logger.init_args.save_dir", str(tmp_path), "--plot.enabled", "false", *extra)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out
    metrics = next(tmp_path.rglob("metrics.csv")).read_text()
    assert "train/loss" in metrics and "val/loss" in metrics
    shutil.rmtree(tmp_path, ignore_errors=True)
