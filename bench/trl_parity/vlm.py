"""TRL 1.16's SFT, DPO and GRPO losses on a tiny Qwen2-VL with images, saved for tests/vision/test_trl_vlm_parity.py.

Regenerate by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    make .venv-bench/.installed      # if the bench venv is not there yet
    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/trl_parity/vlm.py   # writes tests/fixtures/trl_vlm_parity.pt

Nothing of lightalign is imported. The model is the shipped ``assets/models/tiny-qwen2-vl`` folder built with
``from_config`` under ``torch.manual_seed(0)``, its ``initializer_range`` raised from 0.02 to 0.2 (``INIT_STD``: with
near-uniform attention the images and the positions would barely move the losses) (float32; its state dict is saved,
211k parameters); the reference
model is that model with the last decoder layer's ``down_proj`` and the final norm taken from a second seeded build
(only those tensors are saved, ``ref_overrides``), so reference log-probs differ from the policy's. The processor is the
folder's ``Qwen2VLProcessor`` built image-only (without its video processor, which needs torchvision), as
``lightalign.vision.load_processor`` builds it. Rows are the shipped demo data's, named by file and row index; the
images are opened with PIL from the paths the rows give, relative to the data file.

Each case records TRL's own batch (its collator, or its GRPO rollout code), the loss its trainer computes on it (a
method called on a stand-in ``self`` carrying only what it reads; the models patched with TRL's
``add_fused_lm_head`` as its trainers patch them), the logged statistics, and the gradients of a few parameters
(the vision block's qkv projection, the first decoder layer's query projection, the final norm) and the norm of
all parameters' gradients together. Each batch names its images in order (``image_keys``;
``images`` holds each image's ``image_grid_thw`` and its pixel rows processed alone, as three sums,
``pixel_summary``): the script checks TRL's batch ``pixel_values`` are those rows concatenated, and saves the
batch's own summary instead of its pixel values.

* ``sft``: ``DataCollatorForVisionLanguageModeling`` then ``SFTTrainer.compute_loss`` (``loss_type="nll"``, no
  ``num_items_in_batch``), on rows 0, 3 of ``vlm_sft.jsonl`` (conversations): ``full`` (TRL's default for
  conversations: every non-padding token is a label, image tokens included), ``full_without_image_tokens`` (the same
  batch with the labels on image tokens set to -100 before the same loss code: what a loss that never predicts
  image tokens gives), ``assistant_only`` (``assistant_only_loss=True``: the template's generation markers).
* ``dpo``: ``DataCollatorForVisionPreference`` then ``DPOTrainer._compute_loss`` with a reference model, beta 0.1,
  ``loss_type`` ``sigmoid`` and ``ipo``, on rows 0, 1 of ``vlm_preference.jsonl``.
* ``grpo``: rows 0, 2 of ``vlm_prompts.jsonl``, each repeated for ``num_generations=2`` as TRL's sampler repeats
  them, through ``GRPOTrainer._generate_and_score_completions`` (its prompt tokenization with the images, its
  padding, its image forward inputs and its reference forward) with generation replaced by scripted completion ids
  and the reward functions by scripted rewards (TRL turns them into advantages, ``scale_rewards="group"``); then
  ``GRPOTrainer._compute_loss`` (TRL's per-token log-prob forward with the images) with scripted old log-probs
  (the policy's own plus seeded noise, so the clip acts), beta 0.04 (TRL's default ``use_bias_correction_kl``: the
  KL term times the ratio), epsilon 0.2, ``loss_type`` ``grpo`` and
  ``dapo``.

The file is ~1.2 MB (the state dict is most of it; pixel rows are saved as three sums per image or batch,
``pixel_summary``); regenerating it reproduces the same tensors.
"""

from __future__ import annotations

import copy
import json
import os
import types
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig  # noqa: E402
from trl.trainer.dpo_trainer import DataCollatorForVisionPreference, DPOTrainer  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling, SFTTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "assets" / "models" / "tiny-qwen2-vl"
DATA = ROOT / "examples" / "data"
OUT = ROOT / "tests" / "fixtures" / "trl_vlm_parity.pt"
SFT_ROWS, DPO_ROWS, GRPO_ROWS = (0, 3), (0, 1), (0, 2)
NUM_GENERATIONS = 2
INIT_STD = 0.2
GRAD_PARAMS = ("model.visual.blocks.0.attn.qkv.weight", "model.language_model.layers.0.self_attn.q_proj.weight",
               "model.language_model.norm.weight")
REF_OVERRIDE_PREFIXES = ("model.language_model.layers.1.mlp.down_proj.", "model.language_model.norm.")
# Scripted completions (token ids of the tiny tokenizer; the last row ends without EOS) and rewards, per rollout row.
COMPLETION_TEXTS = ("green<|im_end|>", "red and blue<|im_end|>", "3<|im_end|>", "five")
REWARDS = (1.0, 0.0, 1.0, 0.5)


def load_processor(**kwargs):
    """The folder's processor without its video half (image-only), as lightalign builds it without torchvision."""
    cls = transformers.Qwen2VLProcessor
    attributes = [a for a in cls.get_attributes() if a != "video_processor"]
    image_only = type(cls.__name__, (cls,), {"get_attributes": classmethod(lambda _: list(attributes)),
                                             "__module__": cls.__module__})
    return image_only.from_pretrained(MODEL, **kwargs)


def build_model(seed: int) -> torch.nn.Module:
    """The folder's model from its config, initialised with a wider spread (``INIT_STD``) than its 0.02, so the
    attention is peaked enough for the image features and the positions to move the losses clearly."""
    config = AutoConfig.from_pretrained(MODEL)
    for part in (config, config.text_config, config.vision_config):
        part.initializer_range = INIT_STD
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    return model.float().train()


def rows(file: str, indices) -> tuple[list[dict], list[str]]:
    lines = (DATA / file).read_text().splitlines()
    out = []
    for i in indices:
        row = json.loads(lines[i])
        row["images"] = [Image.open(DATA / path).convert("RGB") for path in row["images"]]
        out.append(row)
    return out, [f"{file}:{i}" for i in indices]


def pixel_summary(pixels: torch.Tensor) -> torch.Tensor:
    """Pixel rows in three numbers (sum, sum of squares, a position-weighted sum that changes when rows or
    columns are reordered), in float64: what the tests compare with tolerance instead of saving every value."""
    x = pixels.double()
    weights = torch.linspace(1.0, 2.0, x.numel(), dtype=torch.float64).view_as(x)
    return torch.stack([x.sum(), (x * x).sum(), (x * weights).sum()])


def image_pixels(processor, image) -> dict[str, torch.Tensor]:
    out = processor.image_processor(images=[image], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def record_images(store: dict, processor, keys: list[str], row_images: list[list]) -> None:
    for key, images in zip(keys, row_images):
        for j, image in enumerate(images):
            name = f"{key}:{j}"
            if name not in store:
                store[name] = image_pixels(processor, image)


def stored_batch(batch: dict, image_keys: list[str], images: dict) -> dict[str, torch.Tensor]:
    """TRL's batch without ``pixel_values`` after checking they are the named images' pixel rows in order."""
    expected = torch.cat([images[k]["pixel_values"] for k in image_keys])
    assert torch.equal(batch["pixel_values"], expected), "TRL's pixel rows are not the images' own rows in order"
    assert torch.equal(batch["image_grid_thw"], torch.cat([images[k]["image_grid_thw"] for k in image_keys]))
    out = {k: v.detach().clone() for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "pixel_values"}
    out["pixel_values_shape"] = torch.tensor(batch["pixel_values"].shape)
    out["pixel_values_summary"] = pixel_summary(batch["pixel_values"])
    return out


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    out = {name: params[name].grad.detach().clone() for name in GRAD_PARAMS}
    # every parameter's gradient in one number (the tied embedding and the patch embedding are too big to save)
    out["norm"] = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in params.values()
                                                        if p.grad is not None]))
    model.zero_grad(set_to_none=True)
    return out


def accelerator():
    return types.SimpleNamespace(
        device=torch.device("cpu"), num_processes=1, process_index=0, is_main_process=True, parallelism_config=None,
        gather=lambda v: v, gather_for_metrics=lambda v: v, reduce=lambda v, reduction="mean": v,
        autocast=lambda: torch.autocast("cpu", enabled=False), sync_gradients=True)


def metrics_of(stand_in) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v[-1], dtype=torch.float64) for k, v in stand_in._metrics["train"].items()}


# ---------------------------------------------------------------- SFT

def sft_loss(model, batch) -> tuple[torch.Tensor, dict]:
    stand_in = types.SimpleNamespace(
        model=model, aux_loss_enabled=False, accelerator=accelerator(), compute_loss_func=None, label_smoother=None,
        args=types.SimpleNamespace(loss_type="nll", average_tokens_across_devices=True, max_length=None),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
        get_tp_size=lambda: 1)
    loss = SFTTrainer.compute_loss(stand_in, model, dict(batch))
    return loss, metrics_of(stand_in)


def sft_cases(model, processor, images: dict) -> list[dict]:
    out = []
    image_token = processor.image_token_id
    for name, assistant_only in (("full", False), ("full_without_image_tokens", False), ("assistant_only", True)):
        examples, keys = rows("vlm_sft.jsonl", SFT_ROWS)
        record_images(images, processor, keys, [e["images"] for e in examples])
        collator = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=assistant_only)
        batch = collator(copy.deepcopy(examples))
        if name == "full_without_image_tokens":
            batch["labels"] = batch["labels"].masked_fill(batch["input_ids"] == image_token, -100)
        image_keys = [f"{k}:0" for k in keys]
        loss, metrics = sft_loss(model, batch)
        loss.backward()
        out.append({"name": name, "rows": keys, "image_keys": image_keys, "assistant_only_loss": assistant_only,
                    "batch": stored_batch(batch, image_keys, images), "loss": loss.detach(), "metrics": metrics,
                    "grads": grads(model)})
    return out


# ---------------------------------------------------------------- DPO

def dpo_cases(model, ref_model, processor, images: dict) -> list[dict]:
    out = []
    for loss_type in ("sigmoid", "ipo"):
        examples, keys = rows("vlm_preference.jsonl", DPO_ROWS)
        record_images(images, processor, keys, [e["images"] for e in examples])
        batch = DataCollatorForVisionPreference(processor)(copy.deepcopy(examples))
        image_keys = [f"{k}:0" for k in keys] * 2  # chosen rows, then rejected rows
        stand_in = types.SimpleNamespace(
            model=model, ref_model=ref_model, accelerator=accelerator(), aux_loss_enabled=False, ld_alpha=None,
            precompute_ref_logps=False, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
            beta=0.1, label_smoothing=0.0, use_weighting=False,
            args=types.SimpleNamespace(gradient_checkpointing_kwargs=None, max_length=None),
            _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
        loss = DPOTrainer._compute_loss(stand_in, model, dict(batch), return_outputs=False)
        loss.backward()
        out.append({"loss_type": loss_type, "beta": 0.1, "rows": keys, "image_keys": image_keys,
                    "batch": stored_batch(batch, image_keys, images), "loss": loss.detach(),
                    "metrics": metrics_of(stand_in), "grads": grads(model)})
    return out


# ---------------------------------------------------------------- GRPO

def grpo_trainer(model, ref_model, processor, loss_type: str, completion_ids: list[list[int]]) -> GRPOTrainer:
    """A GRPOTrainer built without ``__init__``: only what the rollout and the loss read (one process, no vLLM, no
    tools, generation and reward functions scripted)."""
    t = GRPOTrainer.__new__(GRPOTrainer)
    t.__dict__.update(
        model=model, ref_model=ref_model, processing_class=processor, _tokenizer=processor.tokenizer, _is_vlm=True,
        accelerator=accelerator(), environment_factories=None, environments=None, tools=[], rollout_func=None,
        chat_template=None, chat_template_kwargs={}, num_generations=NUM_GENERATIONS,
        num_generations_eval=NUM_GENERATIONS, num_iterations=1, use_vllm=False, pad_to_multiple_of=None,
        mask_truncated_completions=False, beta=0.04,
        eos_token_ids=list(GenerationConfig.from_pretrained(MODEL).eos_token_id),
        multi_objective_aggregation="sum_then_normalize", reward_weights=torch.ones(1), scale_rewards="group",
        reward_func_names=["scripted"], log_multimodal=False, is_deepspeed_enabled=False,
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list), "images": []},
        _pending_extra_logs={}, _pending_metrics={}, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        state=types.SimpleNamespace(num_input_tokens_seen=0, global_step=0),
        args=types.SimpleNamespace(per_device_train_batch_size=len(completion_ids), steps_per_generation=1,
                                   gradient_accumulation_steps=1, gradient_checkpointing_kwargs=None,
                                   use_bias_correction_kl=True, delta=None, report_to=[], device=torch.device("cpu"),
                                   past_index=-1),
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.2, importance_sampling_level="token",
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, vllm_importance_sampling_correction=False,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, current_gradient_accumulation_steps=1,
    )
    t._generate_single_turn = lambda prompt_ids, images, fields, n, has_tool_images=False: (completion_ids, None)
    t._calculate_rewards = lambda inputs, prompts, completions, ids: torch.tensor(REWARDS).unsqueeze(1)
    return t


def grpo_cases(model, ref_model, images: dict) -> list[dict]:
    processor = load_processor(padding_side="left", truncation_side="left")  # as GRPOTrainer loads its own
    tokenizer = processor.tokenizer
    completion_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in COMPLETION_TEXTS]
    out = []
    for loss_type in ("grpo", "dapo"):
        examples, keys = rows("vlm_prompts.jsonl", GRPO_ROWS)
        record_images(images, processor, keys, [e["images"] for e in examples])
        repeated = [copy.deepcopy(e) for e in examples for _ in range(NUM_GENERATIONS)]
        row_keys = [k for k in keys for _ in range(NUM_GENERATIONS)]
        image_keys = [f"{k}:0" for k in row_keys]
        trainer = grpo_trainer(model, ref_model, processor, loss_type, completion_ids)
        inputs = trainer._generate_and_score_completions(repeated)
        assert "old_per_token_logps" not in inputs  # steps aligned: TRL takes the policy's own log-probs
        with torch.no_grad():
            own, _, _ = trainer._get_per_token_logps_and_entropies(
                model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].size(1),
                num_images=inputs["num_images"], pixel_values=inputs["pixel_values"],
                image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=inputs["mm_token_type_ids"])
        noise = torch.randn(own.shape, generator=torch.Generator().manual_seed(7)) * 0.3
        inputs["old_per_token_logps"] = (own + noise) * inputs["completion_mask"]
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        stored = stored_batch(inputs, image_keys, images)
        out.append({"loss_type": loss_type, "beta": 0.04, "epsilon": 0.2, "rows": row_keys,
                    "image_keys": image_keys, "completion_texts": list(COMPLETION_TEXTS),
                    "rewards": torch.tensor(REWARDS),
                    "num_generations": NUM_GENERATIONS, "batch": stored, "per_token_logps": own,
                    "loss": loss.detach(), "metrics": metrics_of(trainer), "grads": grads(model)})
    return out


def main() -> None:
    torch.set_num_threads(1)
    model = build_model(0)
    other = build_model(1)
    ref_overrides = {k: v.detach().clone() for k, v in other.state_dict().items()
                     if k.startswith(REF_OVERRIDE_PREFIXES)}
    ref_model = build_model(0)
    ref_model.load_state_dict(ref_overrides, strict=False)
    ref_model.eval()
    state = {k: v.detach() for k, v in model.state_dict().items()}  # the tied head shares the embedding's storage
    processor = load_processor()
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_fused_lm_head(ref_model)
    images: dict[str, dict[str, torch.Tensor]] = {}
    sft = sft_cases(model, processor, images)
    dpo = dpo_cases(model, ref_model, processor, images)
    grpo = grpo_cases(model, ref_model, images)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"trl_version": str(trl.__version__), "transformers_version": str(transformers.__version__),
                "torch_version": str(torch.__version__), "model": "assets/models/tiny-qwen2-vl",
                "state_dict": state, "ref_overrides": ref_overrides, "grad_params": list(GRAD_PARAMS),
                "images": {k: {"image_grid_thw": v["image_grid_thw"], "pixel_values_shape": torch.tensor(
                    v["pixel_values"].shape), "pixel_values_summary": pixel_summary(v["pixel_values"])}
                    for k, v in images.items()}, "sft": sft, "dpo": dpo, "grpo": grpo}, OUT)
    print(f"TRL {trl.__version__} / transformers {transformers.__version__} -> {OUT} "
          f"({OUT.stat().st_size / 1e6:.2f} MB)")
    for case in sft:
        print(f"  sft {case['name']}: {case['loss'].item():.7f}")
    for case in dpo:
        print(f"  dpo {case['loss_type']}: {case['loss'].item():.7f} "
              f"margin {case['metrics']['rewards/margins'].item():.6f}")
    for case in grpo:
        print(f"  grpo {case['loss_type']}: {case['loss'].item():.7f} "
              f"clipped {case['metrics']['clip_ratio/region_mean'].item():.3f}")


if __name__ == "__main__":
    main()
