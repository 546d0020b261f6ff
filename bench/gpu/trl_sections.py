"""The TRL sections of the GPU check: TRL's SFTTrainer, DPOTrainer and GRPOTrainer on the same model folder, data,
sizes and settings as the lightalign sections (sections.py), timed by the same clock, in TRL's fastest setting
there: ``bf16=True`` (autocast over float32 weights, as lightalign's ``bf16-mixed``), padding-free SFT (TRL then
refuses ``max_length``: the rows are shorter than it), ``flash_attention_2`` where flash-attn is installed.
Skipped (not failed) when TRL is not importable."""

from __future__ import annotations

import importlib.util
from typing import Any

import workload
from sections import Context, batch_lengths, pair_flops
from workload import StepClock, sequence_flops


def common_config(ctx: Context, clock: StepClock, batch: int, accumulate: int) -> dict[str, Any]:
    """The TrainingArguments every TRL section shares (no logging, saving or evaluation; AdamW at a constant
    learning rate, clipping at 1.0; sequential data order as lightalign's ``shuffle=False``)."""
    bf16 = ctx.precision.startswith("bf16")
    extra = {}
    if ctx.device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        extra["model_init_kwargs"] = {"attn_implementation": "flash_attention_2"}
    return {"output_dir": str(ctx.workdir / "trl_out"), "per_device_train_batch_size": batch,
            "gradient_accumulation_steps": accumulate, "max_steps": clock.last, "lr_scheduler_type": "constant",
            "optim": "adamw_torch_fused", "weight_decay": 0.0, "max_grad_norm": 1.0, "bf16": bf16, "fp16": False,
            "use_cpu": ctx.device == "cpu", "dataloader_num_workers": 0, "train_sampling_strategy": "sequential",
            "eval_strategy": "no", "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
            "logging_steps": 10_000, "seed": ctx.seed, **extra}


def clock_callback(clock: StepClock):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.step_end(state.global_step)

    return Clock()


def result(ctx: Context, clock: StepClock, trainer: Any, rename: str) -> dict[str, Any]:
    out = clock.summary()
    out[rename] = out.pop("sequences_per_sec")
    return {**out, "attn_implementation": trainer.model.config._attn_implementation, "precision":
            "bf16=True" if ctx.precision.startswith("bf16") else "fp32", **ctx.memory()}


def trl_sft(ctx: Context) -> dict[str, Any]:
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    info, size = ctx.model, ctx.sizes.sft
    clock = StepClock(size["warmup"], size["steps"], ctx.sync)

    class Metered(SFTTrainer):
        def compute_loss(self, model, inputs, *a, **kw):
            if model.training:
                lengths = batch_lengths(inputs)
                clock.batch(sum(lengths), len(lengths), sequence_flops(info, lengths))
            return super().compute_loss(model, inputs, *a, **kw)

    config = SFTConfig(**common_config(ctx, clock, size["batch"], size["accumulate"]), learning_rate=1e-5,
                       padding_free=True, max_length=None, completion_only_loss=True)
    trainer = Metered(model=info["model_dir"], args=config, callbacks=[clock_callback(clock)],
                      train_dataset=load_dataset("json", data_files=info["data"]["sft"], split="train"))
    trainer.train()
    return {**result(ctx, clock, trainer, "sequences_per_sec"), "layout": "padding_free"}


def trl_dpo(ctx: Context) -> dict[str, Any]:
    from datasets import load_dataset
    from trl import DPOConfig, DPOTrainer

    info, size = ctx.model, ctx.sizes.dpo
    tokens, flops = pair_flops(ctx, info, size["max_length"])
    clock = StepClock(size["warmup"], size["steps"], ctx.sync)

    class Metered(DPOTrainer):
        def compute_loss(self, model, inputs, *a, **kw):
            if model.training:
                pairs = int(inputs["input_ids"].shape[0]) // 2
                clock.batch(round(pairs * tokens), pairs, pairs * flops)
            return super().compute_loss(model, inputs, *a, **kw)

    config = DPOConfig(**common_config(ctx, clock, size["batch"], size["accumulate"]), learning_rate=1e-6,
                       beta=0.1, loss_type=["sigmoid"], max_length=size["max_length"], truncation_mode="keep_start",
                       precompute_ref_log_probs=False)
    trainer = Metered(model=info["model_dir"], args=config, callbacks=[clock_callback(clock)],
                      train_dataset=load_dataset("json", data_files=info["data"]["preference"], split="train"))
    trainer.train()
    return {**result(ctx, clock, trainer, "pairs_per_sec"), "layout": "padded (TRL 1.16's DPO has no padding-free)"}


def trl_grpo(ctx: Context) -> dict[str, Any]:
    from datasets import load_dataset
    from trl import GRPOConfig, GRPOTrainer

    info, size = ctx.model, ctx.sizes.grpo
    clock = StepClock(size["warmup"], size["steps"], ctx.sync)

    class Metered(GRPOTrainer):
        def compute_loss(self, model, inputs, *a, **kw):
            if model.training:
                tokens = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
                samples = int(inputs["prompt_ids"].shape[0])
                clock.batch(tokens, samples, sequence_flops(info, workload.mean_lengths(tokens, samples),
                                                            forwards=1))
            return super().compute_loss(model, inputs, *a, **kw)

    generation = size["prompts"] * size["generations"]
    config = GRPOConfig(**common_config(ctx, clock, generation // size["accumulate"], size["accumulate"]),
                        learning_rate=1e-6, num_generations=size["generations"],
                        max_completion_length=size["completion"], temperature=1.0, top_p=1.0, top_k=0,
                        loss_type="dapo", beta=0.0, use_vllm=False)
    trainer = Metered(model=info["model_dir"], reward_funcs=[workload.token_sum_reward], args=config,
                      callbacks=[clock_callback(clock)],
                      train_dataset=load_dataset("json", data_files=info["data"]["prompts"], split="train"))
    trainer.train()
    return {**result(ctx, clock, trainer, "completions_per_sec"), "sampler": "generate",
            "completions_per_step": generation, "max_completion_length": size["completion"]}


SECTIONS = {"trl_sft": trl_sft, "trl_dpo": trl_dpo, "trl_grpo": trl_grpo}
