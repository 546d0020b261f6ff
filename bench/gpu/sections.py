"""The GPU check's sections on the machine (environment, bf16 matmul peak), the model, and lightalign's training
workloads: SFT / DPO / GRPO through the Python API users call (``SFTModule`` + ``SFTDataModule`` and a Lightning
``Trainer``; likewise DPO and GRPO) and FSDP2 on one device. exactness.py, sampler_sections.py and trl_sections.py
hold the others.

Each section is a function ``(ctx) -> dict`` run in a process of its own by run_check.py; what it returns is its
result (``failed_checks``, a list of sentences, marks it failed while keeping its figures); an exception is its
failure. Trainers run without loggers, checkpoints or progress bars: the timed window is the training loop.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import workload
from workload import Sizes, StepClock, sequence_flops


@dataclass
class Context:
    """What every section gets: the mode, the device, the working folder, the sizes and the earlier results."""

    dry_run: bool
    device: str  # "cuda" or "cpu"
    workdir: Path
    sizes: Sizes
    precision: str
    seed: int

    def prior(self, name: str) -> dict[str, Any]:
        """The result of an earlier section (the model folder, the matmul peak); raises when it did not succeed."""
        path = self.workdir / "results" / f"{name}.json"
        record = json.loads(path.read_text()) if path.exists() else {"status": "not run"}
        if record["status"] != "ok":
            raise RuntimeError(f"needs section {name!r}, which is {record['status']}")
        return record["result"]

    @property
    def model(self) -> dict[str, Any]:
        return self.prior("model")

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def memory(self) -> dict[str, float]:
        """Peak memory of this section's process: GPU allocations on a GPU, resident memory always."""
        import torch

        out = {"peak_rss_mib": workload.harness.peak_rss_mb()}
        if self.device == "cuda":
            out["peak_gpu_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
            out["peak_gpu_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
        return out


def versions() -> dict[str, Any]:
    """Versions and locations of the libraries the check runs on (the carried wheels show as their path), without
    touching the GPU."""
    import importlib.metadata as md

    out: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                           "cpu_count": os.cpu_count()}
    for name in ("torch", "transformers", "lightning", "torchmetrics", "datasets", "jsonargparse", "peft", "trl",
                 "accelerate", "tokenizers", "flash_attn", "vllm", "liger_kernel"):
        spec = importlib.util.find_spec(name)
        if spec is None:
            out[name] = None
            continue
        try:
            version = md.version(name.replace("_", "-"))
        except md.PackageNotFoundError:
            version = "?"
        out[name] = {"version": version, "path": str(Path(spec.origin or "").parent)}
    try:
        out["lightalign_commit"] = subprocess.run(["git", "-C", str(workload.ROOT), "rev-parse", "HEAD"],
                                                  capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):  # no git, or no repository: the copy on the device has no .git
        out["lightalign_commit"] = None
    return out


# --------------------------------------------------------------------------- the machine and the model


def environment(ctx: Context) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"device": ctx.device, "torch_cuda": torch.version.cuda}
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpu_memory_gib=props.total_memory / 2**30,
                   multiprocessors=props.multi_processor_count, cudnn=torch.backends.cudnn.version(),
                   flash_sdp=torch.backends.cuda.flash_sdp_enabled(),
                   bf16_supported=torch.cuda.is_bf16_supported())
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        except OSError as err:
            out["nvidia_smi"] = f"not run: {err}"
    else:
        out["gpu"] = None
        out["cpu"] = platform.processor() or platform.machine()
    return out


def matmul_peak(ctx: Context) -> dict[str, Any]:
    """bf16 FLOP/s of a square ``torch.mm`` (the mean of ``matmul_repeats`` products after three warm-ups): the
    practical peak the training loops' MFU is measured against, beside the datasheet figure."""
    import torch

    n, repeats = ctx.sizes.matmul_n, ctx.sizes.matmul_repeats
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.seed)
    a, b = (torch.randn(n, n, generator=gen, device=ctx.device, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(n, n, device=ctx.device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b, out=out)
    ctx.sync()
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b, out=out)
    ctx.sync()
    seconds = (time.perf_counter() - start) / repeats
    name = torch.cuda.get_device_name(0) if ctx.device == "cuda" else None
    datasheet = next((v for k, v in workload.DATASHEET_BF16.items() if name and k in name), None)
    return {"n": n, "repeats": repeats, "bf16_flops_per_sec": 2 * n**3 / seconds, "gpu": name,
            "datasheet_bf16_flops_per_sec": datasheet}


def model(ctx: Context) -> dict[str, Any]:
    """The random model (saved once; every later section loads this folder) and the workloads' data files."""
    out = workload.build_model(ctx.sizes, ctx.workdir / "model", ctx.seed, ctx.device)
    return {**out, "data": workload.write_data(ctx.sizes, ctx.workdir, ctx.seed)}


# --------------------------------------------------------------------------- training through the Python API


def batch_lengths(batch: dict[str, Any]) -> list[int]:
    """Real sequence lengths of a causal-LM batch: a padding-free row's ``sequence_sizes`` or ``position_ids``
    runs, else the rows' attention-mask sums."""
    sizes = batch.get("sequence_sizes")
    if sizes is not None:
        return [int(n) for n in (sizes.tolist() if hasattr(sizes, "tolist") else sizes)]
    if "position_ids" in batch and batch["input_ids"].shape[0] == 1:
        return workload.harness.sequence_lengths({"position_ids": batch["position_ids"]})
    return workload.harness.sequence_lengths(batch)


def lightning_fit(ctx: Context, module: Any, data: Any, clock: StepClock, count: Any, accumulate: int,
                  strategy: Any = None) -> Any:
    """``module`` fitted on ``data`` for the clock's steps by a Lightning Trainer on the device, with ``count(module,
    batch) -> (tokens, sequences, flops)`` read after every micro-batch."""
    import lightning as L

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.batch(*count(pl_module, batch))
            clock.step_end(trainer.global_step)

    L.seed_everything(ctx.seed, verbose=False)
    extra = {"strategy": strategy} if strategy is not None else {}
    trainer = L.Trainer(accelerator="gpu" if ctx.device == "cuda" else "cpu", devices=1, precision=ctx.precision,
                        max_steps=clock.last, accumulate_grad_batches=accumulate, gradient_clip_val=1.0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[Clock()], **extra)
    trainer.fit(module, data)
    return trainer


def attention_used(module: Any) -> dict[str, Any]:
    report = getattr(module, "adaptations", None)
    return {"attn_implementation": module.model.config._attn_implementation,
            "adaptations": report.as_dict() if hasattr(report, "as_dict") else None}


def sft_count(info: dict[str, Any]):
    def count(module, batch):
        lengths = batch_lengths(batch)
        return sum(lengths), len(lengths), sequence_flops(info, lengths)
    return count


def sft(ctx: Context, strategy: Any = None, sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """SFT, padding-free rows, completion-only loss, AdamW at a constant learning rate."""
    from lightalign import SFTDataModule, SFTModule

    info, size = ctx.model, sizes or ctx.sizes.sft
    clock = StepClock(size["warmup"], size["steps"], ctx.sync)
    module = SFTModule(info["model_dir"], learning_rate=1e-5, lr_scheduler_type="constant")
    data = SFTDataModule(info["data"]["sft"], tokenizer=info["model_dir"], max_length=size["max_length"],
                         batch_size=size["batch"], padding_free=True, num_workers=0, shuffle=False)
    lightning_fit(ctx, module, data, clock, sft_count(info), size["accumulate"], strategy)
    return {**clock.summary(), **attention_used(module), "precision": ctx.precision, "batch": size["batch"],
            "layout": "padding_free", **ctx.memory()}


def pair_flops(ctx: Context, info: dict[str, Any], max_length: int) -> tuple[float, float]:
    """Mean tokens and model FLOPs of one preference pair of the data file: policy forward + backward of
    prompt+chosen and prompt+rejected, plus the reference's forward of both (the work DPO needs, whatever the
    layout: the same figure for both frameworks)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(info["model_dir"])
    rows = [json.loads(line) for line in open(info["data"]["preference"]) if line.strip()]
    tokens = flops = 0.0
    for row in rows:
        lengths = [min(max_length, len(tok(row["prompt"] + row[k], add_special_tokens=False)["input_ids"]))
                   for k in ("chosen", "rejected")]
        tokens += sum(lengths)
        flops += sequence_flops(info, lengths, forwards=1)
    return tokens / len(rows), flops / len(rows)


def dpo(ctx: Context) -> dict[str, Any]:
    """DPO (sigmoid, beta 0.1, the reference forwarding every batch), lightalign's default layout."""
    from lightalign import DPOModule, PreferenceDataModule

    info, size = ctx.model, ctx.sizes.dpo
    tokens, flops = pair_flops(ctx, info, size["max_length"])
    clock = StepClock(size["warmup"], size["steps"], ctx.sync)
    module = DPOModule(info["model_dir"], beta=0.1, loss_type="sigmoid", learning_rate=1e-6,
                       lr_scheduler_type="constant")
    data = PreferenceDataModule(info["data"]["preference"], tokenizer=info["model_dir"], max_length=size["max_length"],
                                max_prompt_length=None, batch_size=size["batch"], num_workers=0, shuffle=False)

    def count(module, batch):
        pairs = int(module.last_batch_samples)
        return round(pairs * tokens), pairs, pairs * flops

    lightning_fit(ctx, module, data, clock, count, size["accumulate"])
    out = clock.summary()
    out["pairs_per_sec"] = out.pop("sequences_per_sec")
    return {**out, **attention_used(module), "precision": ctx.precision, "batch": size["batch"],
            "layout": "prompt_sharing (PreferenceDataModule's default)", **ctx.memory()}


def rollout_count(info: dict[str, Any]):
    """GRPO's work per micro-batch: generation (one forward per prompt and completion token) and the policy's
    forward + backward over them (beta 0: no reference; one iteration: no old-policy pass)."""
    def count(module, batch):
        tokens, samples = int(module.last_batch_tokens), int(module.last_batch_samples)
        return tokens, samples, sequence_flops(info, workload.mean_lengths(tokens, samples), forwards=1)
    return count


def grpo(ctx: Context, backend: str | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """GRPO (dapo, beta 0), one rollout of ``prompts x generations`` completions per optimizer step, padding-free
    training; the sampler is the device's default unless ``backend`` is given."""
    from lightalign import GRPOModule, PromptDataModule

    info, size = ctx.model, ctx.sizes.grpo
    clock = StepClock(size["warmup"], size["steps"], ctx.sync)
    module = GRPOModule(info["model_dir"], reward_funcs=[workload.token_sum_reward],
                        num_generations=size["generations"], generation_batch_size=size["prompts"] * size["generations"],
                        max_completion_length=size["completion"], temperature=1.0, loss_type="dapo", beta=0.0,
                        learning_rate=1e-6, lr_scheduler_type="constant", padding_free=True,
                        generation_backend=backend, **(extra or {}))
    data = PromptDataModule(info["data"]["prompts"], tokenizer=info["model_dir"], num_workers=0, seed=ctx.seed)
    lightning_fit(ctx, module, data, clock, rollout_count(info), size["accumulate"])
    out = clock.summary()
    out["completions_per_sec"] = out.pop("sequences_per_sec")
    chosen = module.sampling.chosen.get("policy", (backend, ""))
    return {**out, **attention_used(module), "sampler": chosen[0], "sampler_note": chosen[1],
            "precision": ctx.precision,
            "completions_per_step": size["prompts"] * size["generations"], "max_completion_length": size["completion"],
            **ctx.memory()}


def fsdp2(ctx: Context) -> dict[str, Any]:
    """The SFT workload under ``FSDP2Strategy`` (``fully_shard`` per decoder layer, bf16 parameters, fp32
    gradient reduction) on one device: it sets up, steps, and its loss is finite."""
    from lightalign.strategies import FSDP2Strategy

    strategy = FSDP2Strategy(param_dtype="bfloat16", reduce_dtype="float32", timeout_s=120)
    out = sft(ctx, strategy=strategy, sizes=ctx.sizes.fsdp2)
    return {**out, "strategy": "FSDP2Strategy(param_dtype=bfloat16, reduce_dtype=float32), 1 device"}


SECTIONS = {"environment": environment, "matmul_peak": matmul_peak, "model": model, "sft": sft, "dpo": dpo,
            "grpo": grpo, "fsdp2": fsdp2}
