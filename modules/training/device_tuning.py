"""Constants tuned by measurement on one device type, in one table: what each sets, its value, the machine and
benchmark that measured it, and the device type it applies to.

Every entry was chosen on the project's CPU machine (``MEASURED_ON``), by the measurement its ``measured`` names
(one, ``static_prompt_bucket``, says it had none of its own); nothing here was measured on a GPU. On any other
device type an entry gives its ``neutral`` value instead: the behaviour nobody tuned (``None``: the feature is off
there). The code that uses a constant reads it here for the device it runs on (``tuned(name, device)``), so a CPU
measurement never decides a GPU run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MEASURED_ON = ("the project's CPU-only machine: 2 cores, x86-64, Linux/glibc, torch 2.13.0 CPU, float32, 2 threads "
               "unless said otherwise (docs/performance.md: its figures, commands and dates)")


@dataclass(frozen=True)
class Tuned:
    value: Any  # the measured value, used on ``device``
    neutral: Any  # what every other device type gets: the untuned behaviour (None: the feature is off)
    device: str  # the device type it was measured on (torch.device.type)
    tunes: str  # what it sets
    measured: str  # the benchmark and the figures behind the value
    read_by: str  # the code that reads it
    machine: str = MEASURED_ON  # where it was measured


TABLE: dict[str, Tuned] = {
    "generation_backend": Tuned(
        value="compact", neutral="generate", device="cpu",
        tunes="the generation backend when generation_backend is unset",
        measured="bench/grpo.py --shape reasoning --threads 2 --steps 8 --warmup 2 --repeats 2 (small model, idle, "
                 "2026-11-24): compact 3.02-3.19 completions/s against generate 1.94 on the whole GRPO step; "
                 "docs/performance.md 'The reasoning workload at 2 threads, idle'",
        read_by="modules/sampling/choice.py (the default backend)"),
    "compact_fraction": Tuned(
        value=0.25, neutral=0.0, device="cpu",
        tunes="compact backend: the share of live rows that must have finished before they are gathered out "
              "(neutral 0: a finished row leaves at the next step)",
        measured="bench/generation.py (small model, 2026-11-23, contended): compacting at every finished row and at a "
                 "quarter of the live rows measured the same (4.15 vs 4.07 CPU ms per token); a quarter makes fewer "
                 "cache copies; docs/performance.md 'The compact backend'",
        read_by="modules/sampling/compact.py (compact_groups)"),
    "compact_grow_cache": Tuned(
        value=True, neutral=False, device="cpu",
        tunes="compact backend: the cache's plain layers get room for the whole completion up front (grow_in_place; "
              "bitwise the same tokens and log-probs either way)",
        measured="GRPO generation, small model, 2 threads, idle (2026-11-24): 1.90 -> 1.83 ms per completion token "
                 "(~4%); docs/performance.md 'In-place KV cache'",
        read_by="modules/sampling/compact.py (compact_groups)"),
    "compact_prepack_linears": Tuned(
        value=True, neutral=False, device="cpu",
        tunes="compact backend: plain float32 nn.Linear layers run on oneDNN-prepacked weights while sampling "
              "(packed_linears)",
        measured="GRPO generation, small model, 2 threads, idle (2026-11-24): 2.32 -> 1.86 ms per completion token "
                 "(1.25x), the same tokens in 5 of 5 seeded rollouts; docs/performance.md 'Prepacked linears'",
        read_by="modules/sampling/compact.py (compact_groups)"),
    "compact_prepack_min_mib": Tuned(
        value=116, neutral=None, device="cpu",
        tunes="compact backend: the linears are prepacked only when a model's eligible linear weights hold at least "
              "this many MiB (the reorder of every weight at each rollout and oneDNN's per-call cost are a loss on "
              "small matrices)",
        measured="the sampling call alone, 8 prompts x 2 completions, 2 threads, idle (2026-11-26): the tiny model "
                 "(3.9 MiB of linear weights) 85.8 ms prepacked vs 53.7 ms plain for 8 new tokens, 273.8 vs 224.3 ms "
                 "for 32; the small model (116 MiB) gains 1.25x (compact_prepack_linears). Sizes between the two "
                 "were not measured: they stay unpacked; docs/performance.md 'Prepacked linears'",
        read_by="modules/sampling/compact.py (compact_groups)"),
    "distill_padding_free": Tuned(
        value=True, neutral=False, device="cpu",
        tunes="DistillModule: padding_free when it is unset (rows packed into one, no padding through the student "
              "and the teacher), where both models run it exactly",
        measured="bench/distill.py --steps 10-20 --repeats 2, tiny student / small teacher, 2 threads, idle "
                 "(2026-11-26, session 18): english rows 2.67 -> 4.37 steps/s (1.64x), arithmetic rows 6.06 -> 7.31 "
                 "(1.21x); docs/distill.md 'Speed and memory against TRL'",
        read_by="modules/distill.py (DistillModule.resolve_padding_free)"),
    "packed_linear_rows_hint": Tuned(
        value=32, neutral=None, device="cpu",
        tunes="the batch size oneDNN's prepacked weight layout is chosen for",
        measured="python bench/packed_linear.py (the small model's 24 MLP matrices, 1-2 threads): hints 8 and 32 "
                 "measured the same from 1 to 32 rows; docs/performance.md 'Prepacked linears'",
        read_by="modules/sampling/packed_linear.py (packed_linears)"),
    "static_prompt_bucket": Tuned(
        value=32, neutral=1, device="cpu",
        tunes="static backend: prompts are left-padded to a multiple of this many tokens so rollouts reuse the "
              "compiled decode graph (neutral 1: no padding, a graph per prompt width)",
        measured="not a timed figure: chosen with the static backend (2026-11-23) because inductor's first "
                 "compilation of the decode step took about 4 minutes on the tiny model on this machine; "
                 "docs/performance.md 'Generation backends on the reasoning workload'",
        read_by="modules/sampling/static.py (bucket_prompts)"),
    "min_saved_scores_per_call": Tuned(
        value=32768, neutral=None, device="cpu",
        tunes="shared-prefix rows (DPO pairs, GRPO groups) under sdpa_varlen: one SDPA call per segment when each "
              "call saves at least this many query-key scores (None: one masked call per row)",
        measured="forward+backward of shared-prefix DPO rows (2026-11-22): short chat pairs (~26-token segments, ~5k "
                 "scores saved per call) 7% faster unsplit, long-tailed pairs (~150-token segments, 42k-62k saved "
                 "per call) 7% faster split; break-even near 30k (commit 4f9e3ca)",
        read_by="modules/adaptations/attention.py (worth_splitting)"),
    "split_packed_sequences": Tuned(
        value=True, neutral=None, device="cpu",
        tunes="padding-free rows under sdpa_varlen: one causal SDPA call per packed sequence (None: only where the "
              "model's own sdpa mask would let packed sequences mix, as measured on its probe)",
        measured="SFT on packed rows: one [T, T] masked SDPA call per row was about 30% of a step at 8 sequences of "
                 "~140 tokens (modules/adaptations/attention.py's note; no benchmark figure of the split alone)",
        read_by="modules/adaptations/layouts.py (split_packed_attention)"),
    "onednn_primitive_cache_capacity": Tuned(
        value=32, neutral=None, device="cpu",
        tunes="bf16 runs: the capacity of oneDNN's and ideep's primitive caches (ONEDNN_PRIMITIVE_CACHE_CAPACITY, "
              "LRU_CACHE_CAPACITY) where the environment sets neither (None: the libraries' 1024 each)",
        measured="SFT, small model, chat rows, batch 8, max_length 256, padding-free, 40 steps, 1 thread, on an AMX "
                 "CPU (2026-11-29): peak RSS 1,745 MiB at the default 1024 (still growing, fp32 1,252), 1,474 at 128, "
                 "1,362 at 64, 1,285-1,297 at 32 (flat after step 4); 787 primitives built at 32 and 64 against 569 at "
                 "1024 (8.1 s against 4.9 s of building in 40 steps); docs/performance.md 'bf16 on CPU'",
        read_by="modules/training/cpu_bf16.py (bound_onednn_caches, at setup of a bf16 CPU run)",
        machine=MEASURED_ON.replace("float32, 2 threads", "bf16 (AVX-512 BF16, AMX), 1 thread")),
    "retain_freed_cpu_memory_bytes": Tuned(
        value=1 << 30, neutral=None, device="cpu",
        tunes="retain_cpu_memory: glibc's mmap and trim thresholds while a PolicyModule runs on this device "
              "(None: the allocator is left alone)",
        measured="bench/dpo.py --frameworks lightalign --repeats 2 --retain-cpu-memory off|on (chat DPO, "
                 "2026-11-23): 23.2 -> 26.6 pairs/s online (+14%), 30.0 -> 33.9 precomputed (+13%), peak RSS "
                 "unchanged; padded SFT within noise; docs/performance.md 'retain_cpu_memory'",
        read_by="modules/training/side_effects.py (ScopedSideEffects.apply, at setup) through "
                "modules/training/acceleration.py"),
}


def _device_type(device: str | torch.device) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def tuned(name: str, device: str | torch.device) -> Any:
    """The constant ``name`` for a run on ``device`` (a ``torch.device`` or a name such as ``"cpu"``,
    ``"cuda:0"``): its measured value on the device type it was measured on, its neutral value elsewhere."""
    try:
        entry = TABLE[name]
    except KeyError:
        raise KeyError(f"no tuned constant {name!r}; the table has {sorted(TABLE)}") from None
    return entry.value if _device_type(device) == entry.device else entry.neutral
