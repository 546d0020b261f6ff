"""What the GPU check runs: the model, the data, the sizes of each workload (``FULL`` on one GPU, ``DRY`` for the CPU
dry run), the reward of the GRPO workloads, the clock that times optimizer steps and the model-FLOP count behind MFU.

The model is Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, vocabulary 151,936,
tied embeddings: 494M parameters) with random weights from a seed, built from a config with the shipped
tokenizer (1,024 tokens): nothing is downloaded. The vocabulary is the real model's, so the output layer and the
log-softmax cost what they cost on Qwen2.5-0.5B; the tokenizer decodes only its own 1,024 ids (others decode to
nothing), so a random policy's completions run to ``max_completion_length`` (EOS is 2 ids in 151,936) on both
frameworks alike, and the GRPO reward (``token_sum_reward``) reads token ids, not text.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent.parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import data as bench_data  # noqa: E402
import harness  # noqa: E402

#: Qwen2.5-0.5B's architecture (its config.json), random weights.
QWEN25_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
              "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "tie_word_embeddings": True}

#: Dense bf16 tensor-core peaks from the vendor's datasheets (FLOP/s, without sparsity), by a substring of the name
#: torch reports. Printed beside the matmul rate measured in the same run; MFU is given against both.
DATASHEET_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


@dataclass(frozen=True)
class Sizes:
    """Every size of one run of the check (``FULL`` or ``DRY``)."""

    model: dict[str, Any]  # config.json fields over assets/models/tiny's
    matmul_n: int
    matmul_repeats: int
    exact_lengths: tuple[int, ...]  # sequences of the padding-free exactness check
    sft: dict[str, int]
    dpo: dict[str, int]
    grpo: dict[str, int]
    sampler: dict[str, int]
    fsdp2: dict[str, int]
    boxes: dict[str, float] = field(default_factory=dict)  # seconds per section (else ``default_box``)
    default_box: float = 120.0
    budget: float = 500.0  # seconds for all sections together


FULL = Sizes(
    model=QWEN25_05B, matmul_n=8192, matmul_repeats=10, exact_lengths=(37, 300, 5, 128, 211, 64, 1, 90),
    sft={"rows": 32, "mean_words": 400, "max_length": 1024, "batch": 32, "accumulate": 1, "warmup": 3, "steps": 10},
    dpo={"rows": 16, "mean_words": 300, "max_length": 1024, "batch": 16, "accumulate": 1, "warmup": 2, "steps": 8},
    grpo={"prompts": 16, "mean_words": 24, "generations": 8, "completion": 256, "accumulate": 4, "warmup": 1,
          "steps": 3},
    sampler={"prompts": 32, "mean_words": 24, "generations": 4, "new_tokens": 128},
    fsdp2={"rows": 16, "mean_words": 400, "max_length": 1024, "batch": 16, "accumulate": 1, "warmup": 1, "steps": 1},
    boxes={"environment": 60, "matmul_peak": 60, "model": 150, "padding_free_exactness": 90, "grpo": 180,
           "trl_grpo": 180, "sampler_generate": 90, "sampler_compact": 90, "sampler_continuous": 90,
           "sampler_static": 180, "sampler_vllm": 180},
    default_box=150, budget=480,
)

DRY = Sizes(
    model={}, matmul_n=256, matmul_repeats=2, exact_lengths=(7, 19, 1, 12),
    sft={"rows": 4, "mean_words": 16, "max_length": 64, "batch": 4, "accumulate": 1, "warmup": 1, "steps": 1},
    dpo={"rows": 2, "mean_words": 16, "max_length": 64, "batch": 2, "accumulate": 1, "warmup": 1, "steps": 1},
    grpo={"prompts": 2, "mean_words": 6, "generations": 2, "completion": 6, "accumulate": 2, "warmup": 1, "steps": 1},
    sampler={"prompts": 2, "mean_words": 6, "generations": 2, "new_tokens": 4},
    fsdp2={"rows": 2, "mean_words": 16, "max_length": 64, "batch": 2, "accumulate": 1, "warmup": 1, "steps": 1},
    default_box=60, budget=240,
)


def token_sum_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """A reward in TRL's signature read from token ids (a random model's text decodes to little): the sum of a
    completion's ids modulo 7, so rewards differ within every group and the loss has work to do."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def build_model(sizes: Sizes, out_dir: Path, seed: int, device: str) -> dict[str, Any]:
    """The shipped tiny model's folder (tokenizer, chat template) with ``sizes.model``'s config fields, random
    float32 weights from ``seed`` (initialised on ``device``), saved to ``out_dir``. Returns the parameter count
    (tied embeddings once) and the shape the FLOP count needs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(ROOT / "assets" / "models" / "tiny", out_dir)
    config_path = out_dir / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **sizes.model}, indent=2))
    if sizes.model.get("num_hidden_layers"):
        config = json.loads(config_path.read_text())
        config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
        config_path.write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out_dir), dtype=torch.float32)
    model.save_pretrained(out_dir)
    shape = harness.model_shape(out_dir)
    return {"model_dir": str(out_dir), "n_params": sum(p.numel() for p in model.parameters()), **shape,
            "vocab_size": model.config.vocab_size, "config": {k: v for k, v in json.loads(
                config_path.read_text()).items() if k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                          "num_attention_heads", "num_key_value_heads",
                                                          "vocab_size", "tie_word_embeddings")}}


def write_data(sizes: Sizes, workdir: Path, seed: int) -> dict[str, str]:
    """The JSONL files of the workloads (bench/data.py's generated rows, uniform lengths): SFT prompt-completion,
    preference pairs, prompts. Enough rows for warm-up + timed steps (and the FSDP2 step)."""
    sft_rows = max(sizes.sft["batch"] * sizes.sft["accumulate"] * (sizes.sft["warmup"] + sizes.sft["steps"]),
                   sizes.fsdp2["batch"] * (sizes.fsdp2["warmup"] + sizes.fsdp2["steps"]))
    dpo_rows = sizes.dpo["batch"] * sizes.dpo["accumulate"] * (sizes.dpo["warmup"] + sizes.dpo["steps"])
    prompts = max(sizes.grpo["prompts"] * (sizes.grpo["warmup"] + sizes.grpo["steps"]), sizes.sampler["prompts"])
    return {
        "sft": str(bench_data.write(workdir / "sft.jsonl", "sft", "uniform", sft_rows, sizes.sft["mean_words"], seed)),
        "preference": str(bench_data.write(workdir / "preference.jsonl", "preference", "uniform", dpo_rows,
                                           sizes.dpo["mean_words"], seed)),
        "prompts": str(bench_data.write(workdir / "prompts.jsonl", "prompts", "uniform", prompts,
                                        sizes.grpo["mean_words"], seed)),
    }


class StepClock:
    """Times optimizer steps ``warmup + 1 .. warmup + steps`` of a training run and sums the work of their
    micro-batches. ``batch(tokens, sequences, flops)`` after every micro-batch, ``step_end(global_step)`` after
    each (it acts when the step count changes); ``sync`` (``torch.cuda.synchronize`` on a GPU) runs at both ends
    of the window so queued kernels are counted inside it."""

    def __init__(self, warmup: int, steps: int, sync: Any = None) -> None:
        self.warmup, self.last, self.sync = warmup, warmup + steps, sync or (lambda: None)
        self.seen = 0
        self.start = self.seconds = None
        self.pending = [0, 0, 0.0]
        self.tokens = self.sequences = 0
        self.flops = 0.0
        self.step_seconds: list[float] = []
        self._previous = None

    def batch(self, tokens: int, sequences: int, flops: float) -> None:
        self.pending = [self.pending[0] + tokens, self.pending[1] + sequences, self.pending[2] + flops]

    def step_end(self, step: int) -> None:
        if step == self.seen:
            return  # still accumulating
        self.seen = step
        if step == self.warmup:
            self.sync()
            self.start = self._previous = time.perf_counter()
        elif self.start is not None and self.seconds is None:
            self.tokens += self.pending[0]
            self.sequences += self.pending[1]
            self.flops += self.pending[2]
            if step == self.last:
                self.sync()
            now = time.perf_counter()
            self.step_seconds.append(now - self._previous)
            self._previous = now
            if step == self.last:
                self.seconds = now - self.start
        self.pending = [0, 0, 0.0]

    def summary(self) -> dict[str, Any]:
        if self.seconds is None:
            raise RuntimeError(f"training stopped before optimizer step {self.last} (steps seen: {self.seen}).")
        return {"timed_steps": self.last - self.warmup, "seconds": self.seconds, "tokens": self.tokens,
                "sequences": self.sequences, "tokens_per_sec": self.tokens / self.seconds,
                "sequences_per_sec": self.sequences / self.seconds, "model_flops_per_sec": self.flops / self.seconds,
                "step_seconds": self.step_seconds}


def sequence_flops(model: dict[str, Any], lengths: list[int], forwards: int = 0, trains: int = 1) -> float:
    """Model FLOPs of ``trains`` forward + backward passes and ``forwards`` forward-only passes over sequences of
    these lengths (bench/harness.py's formula: 6N per token trained, 2N per token forwarded, plus attention)."""
    args = (model["n_params"], model["layers"], model["hidden"], lengths)
    return trains * harness.train_flops(*args) + forwards * harness.forward_flops(*args)


def mean_lengths(tokens: int, sequences: int) -> list[int]:
    """``sequences`` lengths summing to ``tokens`` (as even as integers allow): the attention term of a batch known
    only by its totals."""
    if sequences <= 0:
        return []
    base, extra = divmod(int(tokens), int(sequences))
    return [base + 1] * extra + [base] * (sequences - extra)
