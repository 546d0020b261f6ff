"""Online methods on image prompts (GRPO, RLOO, online DPO): the prompt batch carries each row's images, sampling
(``generate``) and every log-prob forward read them, an mRoPE model computes its own positions, reward functions
receive the images, what is not exact with images is refused naming the knob, and the shipped configs run."""

from __future__ import annotations

import csv
import json
import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from helpers import console_script  # noqa: E402

VLM = "assets/models/tiny-qwen2-vl"
ANSWERS = ["green", "2", "yes"]


def _rows(repo):
    images = repo / "examples/data/vlm_images"
    return [
        {"prompt": [{"role": "user", "content": "What color?"}], "images": [str(images / "prompts_0001.png")],
         "answer": ANSWERS[0]},
        {"prompt": [{"role": "system", "content": "Answer with one word."},
                    {"role": "user", "content": "Which image has more circles, the first or the second one?"}],
         "images": [str(images / "prompts_0002.png"), "prompts_0003.png"], "answer": ANSWERS[1]},
        {"prompt": [{"role": "user", "content": "Say yes."}], "images": [], "answer": ANSWERS[2]},
    ]


def _write(folder, rows, name="prompts.jsonl"):
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def setup(repo, tmp_path_factory):
    """The tiny Qwen2-VL (random weights, seeded), the prompt data module on three rows with string contents (the
    placeholders inserted at the first user turn): one image; two images, one path relative to the data file's
    folder; none) and its collated batch."""
    from lightalign import PromptDataModule
    from lightalign.hub import load_causal_lm

    folder = tmp_path_factory.mktemp("vlm_online")
    (folder / "prompts_0003.png").write_bytes((repo / "examples/data/vlm_images/prompts_0003.png").read_bytes())
    data = PromptDataModule(str(_write(folder, _rows(repo))), tokenizer=str(repo / VLM), max_prompt_length=512)
    data.setup("fit")
    rows = [data.train_dataset[i] for i in range(3)]
    batch = data.collate_fn()(rows)
    torch.manual_seed(0)
    model = load_causal_lm(str(repo / VLM), from_config=True).eval()
    return SimpleNamespace(data=data, rows=rows, batch=batch, model=model, processor=data.processor, folder=folder)


def _scripted_rollout(batch, repeats=2):
    """The batch's prompts each ``repeats`` times with constructed completions of different lengths (padded after)."""
    from lightalign.datamodules.image_prompts import repeated_prompt_inputs

    rows = batch["prompt_input_ids"].shape[0] * repeats
    gen = torch.Generator().manual_seed(1)
    completion = torch.randint(5, 200, (rows, 5), generator=gen)
    lengths = torch.tensor([5, 3, 4, 1, 2, 5][:rows])
    mask = (torch.arange(5)[None] < lengths[:, None]).long()
    return {"prompt_ids": batch["prompt_input_ids"].repeat_interleave(repeats, 0),
            "prompt_mask": batch["prompt_attention_mask"].repeat_interleave(repeats, 0),
            "completion_ids": completion.masked_fill(mask == 0, 0), "completion_mask": mask,
            **repeated_prompt_inputs(batch, repeats)}


def _alone_logps(setup, row, completion):
    """The completion's per-token log-probs with the row processed alone by the processor (no padding, the model's
    own positions): what each row of a batch must equal."""
    from lightalign.vision.images import load_image

    images = [load_image(ref, where="test") for ref in row["image_refs"]]
    if images:
        out = setup.processor(text=[row["prompt_text"]], images=[images], return_tensors="pt", add_special_tokens=False)
    else:
        ids = torch.tensor([row["prompt_input_ids"]])
        out = {"input_ids": ids, "mm_token_type_ids": torch.zeros_like(ids)}
    n = out["input_ids"].shape[1]
    inputs = {**out, "input_ids": torch.cat([out["input_ids"], completion[None]], 1),
              "mm_token_type_ids": torch.cat([out["mm_token_type_ids"], torch.zeros_like(completion)[None]], 1)}
    inputs.pop("attention_mask", None)
    with torch.no_grad():
        logits = setup.model(**inputs).logits[0, n - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, completion[:, None])[:, 0]


def test_prompt_batch_is_the_processors_own_left_padded_batch(setup):
    """The collated prompts equal the processor's own left-padded batch of the image rows (ids, token types, pixels),
    and reward columns hold the row's images as PIL images (TRL's ``images``)."""
    batch, rows = setup.batch, setup.rows
    images = [[Image.open(r["path"]).convert("RGB") for r in row["image_refs"]] for row in rows[:2]]
    own = setup.processor(text=[r["prompt_text"] for r in rows[:2]], images=images, return_tensors="pt",
                          padding=True, padding_side="left", add_special_tokens=False)
    width = own["input_ids"].shape[1]
    assert torch.equal(batch["prompt_input_ids"][:2, -width:], own["input_ids"])
    assert torch.equal(batch["prompt_mm_token_type_ids"][:2, -width:], own["mm_token_type_ids"])
    tensors = batch["prompt_image_inputs"].select([0, 1]).tensors()
    assert torch.equal(tensors["pixel_values"], own["pixel_values"])
    assert torch.equal(tensors["image_grid_thw"], own["image_grid_thw"])
    assert batch["prompt_image_inputs"].images_per_row == [1, 2, 0]
    assert batch["prompt_attention_mask"][2].sum() < batch["prompt_attention_mask"][1].sum()  # left padding
    got = batch["columns"]["images"]
    assert [len(g) for g in got] == [1, 2, 0] and all(isinstance(i, Image.Image) for g in got for i in g)
    assert got[1][1].tobytes() == images[1][1].tobytes()  # the relative path, read from the data file's folder
    assert batch["columns"]["answer"] == ANSWERS and setup.data.has_images


def test_grpo_logps_with_images_equal_each_row_alone(setup):
    """GRPO's per-token log-probs of a left-padded batch of image prompts (and a text row) equal a forward of each
    row alone as the processor makes it, the model computing its 3-D positions (mRoPE). Mutations: the images
    dropped from the forward (``prompt_image_kwargs`` returning ``{}``), or 1-D ``position_ids`` passed to the
    Qwen-VL model (``forward_positions`` ignoring the images) -> the image rows differ."""
    from lightalign.modules.training.logprobs import completion_logits
    from lightalign.modules.training.rollout_forward import grpo_forward

    mb = _scripted_rollout(setup.batch)
    with torch.no_grad():
        logps, _, mask = grpo_forward(setup.model, mb)
        logits = completion_logits(setup.model, mb)  # distillation's forward of the same rows
    via_logits = torch.log_softmax(logits.float(), -1).gather(-1, mb["completion_ids"][..., None])[..., 0]
    for i in range(mb["completion_ids"].shape[0]):
        n = int(mb["completion_mask"][i].sum())
        alone = _alone_logps(setup, setup.rows[i // 2], mb["completion_ids"][i, :n])
        torch.testing.assert_close(logps[i, :n], alone, atol=2e-5, rtol=0)
        torch.testing.assert_close(via_logits[i, :n], alone, atol=2e-5, rtol=0)
    assert mask.sum() == mb["completion_mask"].sum()


def test_generate_samples_with_the_images(setup):
    """``generate`` samples each prompt ``num_generations`` times with its images: the sampler's own log-prob of
    every sampled token equals the training forward's (image placeholders suppressed, as TRL), and no image token is
    sampled. Mutation: the image inputs dropped from ``generate`` (``generate_groups`` without ``prompt_inputs``)
    -> the log-probs of the image rows differ."""
    from lightalign.modules.sampling.completions import sample_completions
    from lightalign.modules.training.logprobs import image_token_ids
    from lightalign.modules.training.rollout_forward import grpo_forward

    torch.manual_seed(0)
    rollout = sample_completions(setup.model, setup.data.tokenizer, setup.batch, 2, share_prefill=False,
                                 backend="generate", return_logprobs=True, max_new_tokens=4, temperature=1.0,
                                 top_p=1.0, top_k=0)
    suppressed = image_token_ids(setup.model)
    assert suppressed and not torch.isin(rollout["completion_ids"], torch.tensor(suppressed)).any()
    assert rollout["prompt_image_inputs"].images_per_row == [1, 1, 2, 2, 0, 0]
    assert [len(i) for i in rollout["columns"]["images"]] == [1, 1, 2, 2, 0, 0]
    with torch.no_grad():
        _, logits, _ = grpo_forward(setup.model, rollout)
    logits = logits.float()
    logits[..., suppressed] = float("-inf")
    forward = torch.log_softmax(logits, -1).gather(-1, rollout["completion_ids"][..., None])[..., 0]
    mask = rollout["completion_mask"].bool()
    torch.testing.assert_close(forward[mask], rollout["sampling_logps"][mask], atol=2e-5, rtol=0)


def test_reward_functions_receive_the_rows_images(setup):
    """A reward function reading ``images`` gets each completion's prompt images (PIL, the data's order), as TRL
    passes them. Mutation: the collator not restoring the image column -> the function raises on a missing
    ``images``."""
    from lightalign.modules.sampling.completions import assemble_rollout
    from lightalign.modules.sampling.samplers import Samples
    from lightalign.rewards import compute_rewards

    def red_share(prompts, completions, images, **kwargs):
        return [sum(px[0] > 200 and px[1] < 100 for im in imgs for px in im.getdata()) / 1e3 for imgs in images]

    samples = Samples(torch.tensor([[7, 8], [9, 10]] * 3))
    rollout = assemble_rollout(setup.data.tokenizer, setup.batch, 2, samples, eos=[setup.data.tokenizer.eos_token_id])
    _, total, _ = compute_rewards([red_share], rollout["prompts"], rollout["completions"], rollout["columns"])
    expect = []
    for row in setup.rows:
        images = [Image.open(r["path"]).convert("RGB") for r in row["image_refs"]]
        expect += [sum(p[0] > 200 and p[1] < 100 for im in images for p in im.getdata()) / 1e3] * 2
    assert total.tolist() == pytest.approx(expect) and expect[0] != expect[2]


def test_a_rollout_with_images_checkpoints_for_a_weights_only_load(setup, tmp_path):
    """The rollout buffer's micro-batches, images included, load back with ``torch.load(weights_only=True)`` (what
    a resumed run reads) and split in the rollout's row order. Mutation: ``RolloutBuffer.state_dict`` keeping the
    ``ImageInputs`` object -> the weights-only load refuses it."""
    from lightalign.modules.rollout.buffer import RolloutBuffer, split_rollout

    mb = _scripted_rollout(setup.batch)
    chunks = split_rollout(mb, mb["completion_mask"].sum(-1), 2, 2, whole_groups=False)
    for chunk in chunks:  # the images follow their rows through the shuffle
        rows = chunk["prompt_image_inputs"].rows
        for i, ids in enumerate(chunk["prompt_ids"]):
            j = next(j for j in range(6) if torch.equal(mb["prompt_ids"][j], ids))
            assert rows[i].keys() == mb["prompt_image_inputs"].rows[j].keys()
            assert all(torch.equal(rows[i][k], mb["prompt_image_inputs"].rows[j][k]) for k in rows[i])
    buffer = RolloutBuffer()
    buffer.fill(chunks)
    torch.save(buffer.state_dict(), tmp_path / "state.pt")
    restored = RolloutBuffer()
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    for before, after in zip(chunks, restored.chunks):
        assert after["prompt_image_inputs"].layout == before["prompt_image_inputs"].layout
        assert torch.equal(after["prompt_image_inputs"].tensors()["pixel_values"],
                           before["prompt_image_inputs"].tensors()["pixel_values"])


def test_backends_other_than_generate_and_unmeasured_layouts_are_refused(setup):
    """Prompts with images sample only on ``generate``: another asked backend is refused naming it, the knob and
    ``generate``; the default picks ``generate`` and says why; ``share_prefill``, ``prompt_sharing``,
    ``padding_free``, vLLM, sampling ahead and tools are refused naming the knob, as is a method that does not take
    image prompts. Mutation: ``choose_sampler`` ignoring ``images`` -> compact is chosen, not refused."""
    from lightalign.modules.sampling.choice import choose_sampler
    from lightalign.modules.sampling.config import SamplingConfig
    from lightalign.modules.sampling.image_prompts import check_image_prompts
    from lightalign.modules.sampling.samplers import sample_groups

    for backend in ("compact", "continuous", "static"):
        refused = f"backend '{backend}' \\(generation_backend.*set generation_backend: generate"
        with pytest.raises(ValueError, match=refused):
            choose_sampler(setup.model, SamplingConfig(backend=backend, share_prefill=False), 2, images=True)
    assert choose_sampler(setup.model, SamplingConfig(share_prefill=False), 2, images=True) == (
        "generate", "generation generate (the prompts have images: only generate samples with them)")
    with pytest.raises(ValueError, match="share_prefill=True .* set share_prefill: false"):
        choose_sampler(setup.model, SamplingConfig(), 2, images=True)
    with pytest.raises(ValueError, match="backend 'static'.*generate"):
        sample_groups(setup.model, setup.batch["prompt_input_ids"], setup.batch["prompt_attention_mask"], 2,
                      backend="static", eos=[0], pad_token_id=0, max_new_tokens=2, prompt_inputs={"pixel_values": 1})
    for knob, value in (("use_vllm", True), ("prompt_sharing", True), ("padding_free", True), ("max_staleness", 2),
                        ("tools", ["m.f"]), ("environment_factory", "m.Env")):
        module = SimpleNamespace(takes_image_prompts=True, hparams={knob: value, "use_vllm": knob == "use_vllm"})
        with pytest.raises(ValueError, match=re.escape(f"{knob}={value!r} is not available with prompts that have")):
            check_image_prompts(module)
    check_image_prompts(SimpleNamespace(takes_image_prompts=True, hparams={"max_staleness": 0, "tools": None}))
    with pytest.raises(ValueError, match="SimpleNamespace does not train on prompts with images"):
        check_image_prompts(SimpleNamespace(hparams={}))


def test_bad_image_rows_are_refused_naming_the_row(repo, tmp_path):
    """At setup: a missing image, a placeholder count that differs from the images, a string prompt with images,
    a prompt longer than max_prompt_length with its image tokens, and an image column for a text model."""
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color?"}]}]
    from lightalign import PromptDataModule as Data
    from lightalign.datamodules.formats import DataFormatError as Error

    twice = {**_rows(repo)[0], "prompt": parts, "images": _rows(repo)[0]["images"] * 2}
    with pytest.raises(Error, match="train row 0: the conversation has 1 image placeholder.*row has 2 image"):
        Data(str(_write(tmp_path, [twice])), tokenizer=str(repo / VLM)).setup("fit")
    from lightalign import PromptDataModule
    from lightalign.datamodules.formats import DataFormatError

    good = _rows(repo)[:1]
    cases = [
        (good + [{**good[0], "images": ["nowhere.png"]}],
         r"train row 1, column 'images'\[0\]: the image 'nowhere.png' does not exist"),
        ([{**good[0], "prompt": "What color?"}], "train row 0: a prompt with images must be a conversation"),
    ]
    for rows, message in cases:
        data = PromptDataModule(str(_write(tmp_path, rows)), tokenizer=str(repo / VLM))
        with pytest.raises(DataFormatError, match=message):
            data.setup("fit")
    data = PromptDataModule(str(_write(tmp_path, good)), tokenizer=str(repo / VLM), max_prompt_length=8)
    with pytest.raises(DataFormatError, match="train row 0: the prompt has .* tokens with its image tokens, more than "
                                              "max_prompt_length \\(8\\)"):
        data.setup("fit")
    data = PromptDataModule(str(_write(tmp_path, good)), tokenizer=str(repo / "assets/models/tiny"))
    with pytest.raises(DataFormatError, match="has an 'images' column, and .* is a text model"):
        data.setup("fit")


def test_text_prompts_for_a_vision_language_model_carry_no_images(repo, tmp_path):
    """Prompts without an image column, for a vision-language model: the rows prepare, no image is announced, and
    the batch has no image rows (sampling and forwards take the text path)."""
    from lightalign import PromptDataModule
    from lightalign.datamodules.image_prompts import has_image_rows

    rows = [{"prompt": [{"role": "user", "content": "Say yes."}], "answer": "yes"}]
    data = PromptDataModule(str(_write(tmp_path, rows)), tokenizer=str(repo / VLM))
    data.setup("fit")
    batch = data.collate_fn()([data.train_dataset[0]])
    assert not data.has_images and not has_image_rows(batch) and batch["columns"] == {"answer": ["yes"]}


def _fit(repo, tmp_path, config, *args):
    out = console_script.run(repo, "fit", "--config", str(repo / "configs" / config),
                             "--trainer.logger.init_args.save_dir", str(tmp_path), *args,
                             env=console_script.standard_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    return out, {k for row in rows for k, v in row.items() if v}, rows


@pytest.mark.parametrize("config, steps, logged", [
    ("vlm_grpo_tiny.yaml", 2, {"train/reward/mean", "train/kl", "train/loss"}),
    ("vlm_rloo_tiny.yaml", 1, {"train/reward/mean", "train/kl", "train/loss"}),
    ("vlm_online_dpo_tiny.yaml", 1, {"train/reward/mean", "train/loss", "train/rewards/margins"}),
])
def test_shipped_vlm_online_configs_train_through_the_console_script(repo, tmp_path, config, steps, logged):
    """Each shipped config trains on the demo image prompts (GRPO two steps; RLOO and online DPO one), sampling on
    ``generate`` with the images. Mutations: the rollout's micro-batches without the prompts' images
    (``_make_rollout``), or online DPO's pair forward without them (``pair_logps``) -> the forward refuses image
    placeholder tokens without images, and the run fails."""
    out, keys, rows = _fit(repo, tmp_path, config, "--trainer.max_steps", str(steps), "--export.enabled", "false")
    assert logged <= keys and max(int(r["step"]) for r in rows) == steps - 1
    assert "generation generate (the prompts have images: only generate samples with them)" in out.stdout + out.stderr
