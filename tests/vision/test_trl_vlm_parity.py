"""SFT, DPO and GRPO on a tiny Qwen2-VL with images against TRL 1.16 on identical tensors
(tests/fixtures/trl_vlm_parity.pt, written by bench/trl_parity/vlm.py in the bench venv: TRL's own collators, rollout
code and loss code on the same model weights and the same demo-data rows).

Per method: our datamodule's collator builds the batch from the same rows (the rows the fixture names, written to a
data file with their images); its tensors equal TRL's batch where the layouts correspond (ids, masks, labels,
``mm_token_type_ids``, the image grids, the pixel rows' sums); the fixture's state dict is loaded; our loss (the
module's own loss path on that batch) and the gradients of the saved parameters (and the norm of all gradients)
equal TRL's within float32 rounding.

The tolerance: TRL's fused LM head computes the log-probs tile by tile, ours with a full ``log_softmax``, both in
float32 over a 1029-token vocabulary and sums of <= 50 tokens: relative 1e-5 of the largest value of each compared
tensor (measured: <= 1e-6 on AVX-512 kernels, <= 3e-6 under ATEN_CPU_CAPABILITY=avx2 against the fixture written
on AVX-512). The fixture's weights are initialised with a 0.2 spread, so images and positions move the results by
far more than that.

Mutations run, each failing these tests: the image inputs dropped from the forwards (``model_inputs`` returning
``{}``: SFT and DPO losses off by 3-7% relative; ``prompt_image_kwargs`` returning ``{}``: GRPO's per-token log-probs
off by up to 3.1); 1-D ``position_ids`` passed to the Qwen2-VL forward (``sft_logits`` given the attention mask's
cumulative count: SFT loss off by 1e-3 relative; the same in DPO's ``completion_token_logps_and_alignment``: DPO loss
off by 0.08; ``forward_positions`` ignoring the images: GRPO's log-probs off by up to 2.8); image tokens counted in
the SFT loss (``image_token_mask`` returning all False): our labels are then TRL's full-sequence labels, not
``full_without_image_tokens``'s (whose loss differs from TRL's ``full`` loss by 1.7e-3 relative).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("PIL")

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "trl_vlm_parity.pt"
QWEN = REPO / "assets" / "models" / "tiny-qwen2-vl"
DATA = REPO / "examples" / "data"
TOLERANCE = 1e-5


@functools.cache
def parity() -> dict:
    data = torch.load(FIXTURE, weights_only=True)
    assert data["trl_version"] == "1.16.0"
    return data


def build_model(reference: bool = False) -> torch.nn.Module:
    """The fixture's policy (or reference: the policy with the saved overrides) in float32."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(QWEN)).float()
    model.load_state_dict(parity()["state_dict"])
    if reference:
        model.load_state_dict(parity()["ref_overrides"], strict=False)
    return model


def write_rows(folder: Path, names: list[str], transform=None) -> Path:
    """The fixture's rows (``file:index`` of the demo data, in order, without repeats) in a data file of their own,
    image paths made absolute."""
    rows = []
    for name in dict.fromkeys(names):
        file, index = name.split(":")
        row = json.loads((DATA / file).read_text().splitlines()[int(index)])
        row["images"] = [str(DATA / path) for path in row["images"]]
        rows.append(transform(row) if transform else row)
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pixel_summary(pixels: torch.Tensor) -> torch.Tensor:
    """bench/trl_parity/vlm.py's three sums of pixel rows."""
    x = pixels.double()
    weights = torch.linspace(1.0, 2.0, x.numel(), dtype=torch.float64).view_as(x)
    return torch.stack([x.sum(), (x * x).sum(), (x * weights).sum()])


def assert_images_match(tensors: dict[str, torch.Tensor], case: dict) -> None:
    """Our batch's image tensors are TRL's: the same grids in the same order, the same pixel rows (their sums)."""
    batch = case["batch"]
    assert torch.equal(tensors["image_grid_thw"], batch["image_grid_thw"])
    assert tuple(tensors["pixel_values"].shape) == tuple(batch["pixel_values_shape"].tolist())
    torch.testing.assert_close(pixel_summary(tensors["pixel_values"]), batch["pixel_values_summary"],
                               rtol=1e-9, atol=1e-6)


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    scale = max(1.0, theirs.abs().max().item()) if theirs.dim() == 0 else theirs.abs().max().item()
    assert scale > 0, what
    error = (ours.detach().double() - theirs.double()).abs().max().item()
    assert error <= TOLERANCE * scale, f"{what}: max difference {error:.3g} vs TRL's scale {scale:.3g}"


def assert_grads_match(model: torch.nn.Module, case: dict) -> None:
    params = dict(model.named_parameters())
    for name in parity()["grad_params"]:
        assert_close(params[name].grad, case["grads"][name], name)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in params.values()
                                                 if p.grad is not None]))
    assert_close(norm, case["grads"]["norm"], "gradient norm")


# ---------------------------------------------------------------- SFT

@pytest.fixture(scope="module")
def sft_batches(tmp_path_factory):
    """Our SFT batches of the fixture's rows: labels on every token but the image tokens, and assistant turns only."""
    from lightalign import SFTDataModule

    path = write_rows(tmp_path_factory.mktemp("vlm_parity_sft"), parity()["sft"][0]["rows"])
    out = {}
    for assistant_only in (False, True):
        dm = SFTDataModule(str(path), str(QWEN), batch_size=2, max_length=None, shuffle=False,
                           assistant_only_loss=assistant_only)
        dm.setup("fit")
        out[assistant_only] = dm.collate_fn()([dm.train_dataset[i] for i in range(len(dm.train_dataset))])
    return out


def sft_case(name: str) -> dict:
    return next(c for c in parity()["sft"] if c["name"] == name)


@pytest.mark.parametrize("name", ["full_without_image_tokens", "assistant_only"])
def test_sft_batch_loss_and_gradients_equal_trl(sft_batches, name):
    """Our SFT batch is TRL's vision collator's batch (ids, attention mask, ``mm_token_type_ids``, images); its labels
    are TRL's with the image tokens left out (TRL's ``assistant_only_loss`` labels never hold one); SFTModule's loss
    (``sft_loss`` on ``sft_logits``) and its gradients equal TRL's ``SFTTrainer.compute_loss`` on those labels, and
    its token accuracy TRL's ``mean_token_accuracy``."""
    from lightalign.modules.sft import sft_loss
    from lightalign.modules.training.sft_forward import sft_logits

    case = sft_case(name)
    batch = sft_batches[name == "assistant_only"]
    theirs = case["batch"]
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "labels"):
        assert torch.equal(batch[key], theirs[key]), key
    assert_images_match(batch["image_inputs"].tensors(), case)

    model = build_model()
    loss, stats = sft_loss(sft_logits(model, batch), batch["labels"])
    loss.backward()
    assert_close(loss, case["loss"], "loss")
    assert_grads_match(model, case)
    accuracy = stats["num_correct"] / stats["num_tokens"]
    assert abs(accuracy.item() - case["metrics"]["mean_token_accuracy"].item()) <= 1e-6


def test_sft_leaves_out_the_image_tokens_that_trl_predicts():
    """TRL's default conversation labels hold the image tokens; ours never do: the two losses differ on this batch
    by far more than the tolerance (so the parity above tells them apart), and the label sets differ exactly on
    the image tokens."""
    full, without = sft_case("full"), sft_case("full_without_image_tokens")
    image = full["batch"]["input_ids"] == 1027  # <|image_pad|>
    assert image.sum() == 8
    assert torch.equal(full["batch"]["labels"].masked_fill(image, -100), without["batch"]["labels"])
    assert (full["loss"] - without["loss"]).abs() > 10 * TOLERANCE * without["loss"].abs()


# ---------------------------------------------------------------- DPO

@pytest.fixture(scope="module")
def dpo_batch(tmp_path_factory):
    from lightalign import PreferenceDataModule

    path = write_rows(tmp_path_factory.mktemp("vlm_parity_dpo"), parity()["dpo"][0]["rows"])
    dm = PreferenceDataModule(str(path), str(QWEN), prompt_sharing=False, batch_size=2, shuffle=False)
    dm.setup("fit")
    return dm.collate_fn()([dm.train_dataset[i] for i in range(len(dm.train_dataset))])


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_batch_loss_and_gradients_equal_trl(dpo_batch, loss_type):
    """Our pair batch ([chosen rows; rejected rows], each prompt's images for both) is TRL's vision preference
    collator's (ids where attended, masks, completion mask, ``mm_token_type_ids``, images); DPOModule's loss (policy
    and reference forwards with the images) and gradients equal TRL's ``DPOTrainer._compute_loss``, and so do the
    rewards and log-prob statistics."""
    from lightalign import DPOModule

    case = next(c for c in parity()["dpo"] if c["loss_type"] == loss_type)
    batch, theirs = dpo_batch, case["batch"]
    for key in ("attention_mask", "completion_mask", "mm_token_type_ids"):
        assert torch.equal(batch[key], theirs[key]), key
    assert torch.equal(batch["input_ids"] * batch["attention_mask"], theirs["input_ids"] * theirs["attention_mask"])
    assert_images_match(batch["image_inputs"].tensors(), case)

    policy = build_model()
    module = DPOModule(model=policy, beta=case["beta"], loss_type=loss_type)
    module.ref_model = build_model(reference=True).eval()
    loss = module._step(batch, module.train_stats)
    loss.backward()
    assert_close(loss, case["loss"], "loss")
    assert_grads_match(policy, case)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        ours = module.train_stats[name.replace("/", "_")].compute()
        assert_close(ours, case["metrics"][name].float(), name)


# ---------------------------------------------------------------- GRPO

@pytest.fixture(scope="module")
def grpo_rollout(tmp_path_factory):
    """Our prompt batch of the fixture's rows, each prompt repeated for its generations with TRL's completions."""
    from lightalign import PromptDataModule
    from lightalign.datamodules.image_prompts import repeated_prompt_inputs

    case = parity()["grpo"][0]
    path = write_rows(tmp_path_factory.mktemp("vlm_parity_grpo"), case["rows"])
    dm = PromptDataModule(str(path), tokenizer=str(QWEN), max_prompt_length=512)
    dm.setup("fit")
    batch = dm.collate_fn()([dm.train_dataset[i] for i in range(len(dm.train_dataset))])
    g, theirs = case["num_generations"], case["batch"]
    rollout = {"prompt_ids": batch["prompt_input_ids"].repeat_interleave(g, 0),
               "prompt_mask": batch["prompt_attention_mask"].repeat_interleave(g, 0),
               "completion_ids": theirs["completion_ids"], "completion_mask": theirs["completion_mask"],
               **repeated_prompt_inputs(batch, g)}
    return SimpleNamespace(batch=batch, rollout=rollout)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_batch_loss_and_gradients_equal_trl(grpo_rollout, loss_type):
    """Our prompt batch repeated for the generations is TRL's rollout batch (left-padded prompt ids and mask,
    ``mm_token_type_ids`` over the prompt, images per completion row); ``grpo_forward`` gives TRL's per-token
    log-probs (policy and reference, the images in both forwards, the model's own mRoPE positions), and
    ``grpo_loss`` on them with TRL's advantages and old log-probs gives TRL's ``GRPOTrainer._compute_loss``, its
    gradients (the KL term with TRL's bias correction) and its KL and clip statistics."""
    from lightalign.modules.losses.grpo import GRPOLossConfig, grpo_loss
    from lightalign.modules.training.rollout_forward import grpo_forward

    case = next(c for c in parity()["grpo"] if c["loss_type"] == loss_type)
    mb, theirs = grpo_rollout.rollout, case["batch"]
    prompt_width = theirs["prompt_ids"].shape[1]
    assert torch.equal(mb["prompt_mask"], theirs["prompt_mask"])
    assert torch.equal(mb["prompt_ids"] * mb["prompt_mask"], theirs["prompt_ids"] * theirs["prompt_mask"])
    assert torch.equal(mb["prompt_mm_token_type_ids"], theirs["mm_token_type_ids"][:, :prompt_width])
    assert not theirs["mm_token_type_ids"][:, prompt_width:].any()
    assert_images_match(mb["prompt_image_inputs"].tensors(), case)

    policy, reference = build_model(), build_model(reference=True).eval()
    logps, _, mask = grpo_forward(policy, mb)
    mask = mask.long()
    assert_close(logps.detach() * mask, case["per_token_logps"] * mask, "per-token log-probs")
    with torch.no_grad():
        ref_logps = grpo_forward(reference, mb)[0] * mask
    assert_close(ref_logps, theirs["ref_per_token_logps"], "reference per-token log-probs")
    config = GRPOLossConfig(loss_type=loss_type, epsilon=case["epsilon"], use_bias_correction_kl=True)
    loss, stats = grpo_loss(logps, theirs["old_per_token_logps"], theirs["advantages"], mask, config=config,
                            beta=case["beta"], ref_per_token_logps=ref_logps,
                            num_items_in_batch=theirs["num_items_in_batch"])
    loss.backward()
    assert_close(loss, case["loss"], "loss")
    assert_grads_match(policy, case)
    for name in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert_close(stats[name], case["metrics"][name].float(), name)
    assert case["metrics"]["clip_ratio/region_mean"] > 0  # the scripted old log-probs make the clip act
