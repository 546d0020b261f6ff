"""Constants tuned by measurement on one device type, in one table: what each sets, its value, the machine and
benchmark that measured it, and whether it applies on the CPU that runs.

Every entry was chosen on the project's CPU machines (``MEASURED_ON``), by the measurement its ``measured`` names;
nothing here was measured on a GPU. On any other device type an entry gives its ``neutral`` value: the behaviour
nobody tuned (``None``: the feature is off there). On the CPU, kernels differ between machines (AVX2, AVX-512,
AMX; ``machine_key``) and the project's timings did not record theirs (``Tuned.key`` None), so a value applies on
this CPU only in one of these ways (``resolve``; the fit-start line says which, ``tuning_note``):

* ``holds``: the entry says why its value is right on any CPU (counted work, or not a timing at all);
* ``measure``: a micro-measurement (``tuning_measurements``) run on this machine at first use decides between the
  value and the neutral one; its verdict is cached on disk under the machine key, beside the layout probe's
  verdicts, and reused;
* otherwise (a whole benchmark decided it): the value applies only on the key it was measured under, or where a
  verdict for this machine was recorded (``record``); elsewhere the neutral value.

``LIGHTALIGN_TUNING``: ``measure`` (the default, as above), ``table`` (the table's values on any CPU, nothing
measured: the test suite, reproducing the project's figures), ``neutral`` (untuned everywhere).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightalign.modules.training.cache_folder import cache_root
from lightalign.modules.training.machine_key import key_id, machine_key

MEASURED_ON = ("the project's CPU-only machine: 2 cores, x86-64, Linux/glibc, torch 2.13.0 CPU, float32, 2 threads "
               "unless said otherwise; its kernels (AVX2 / AVX-512 / AMX) were not recorded (docs/performance.md: "
               "its figures, commands and dates)")
MODES = ("measure", "table", "neutral")


@dataclass(frozen=True)
class Tuned:
    value: Any  # the measured value, used on ``device``
    neutral: Any  # what every other device type gets: the untuned behaviour (None: the feature is off)
    device: str  # the device type it was measured on (torch.device.type)
    tunes: str  # what it sets
    measured: str  # the benchmark and the figures behind the value
    read_by: str  # the code that reads it
    machine: str = MEASURED_ON  # where it was measured
    key: dict | None = None  # the machine key (``machine_key``) it was measured under; None: not recorded
    holds: str = ""  # why the value is right on any CPU (then it applies on every machine of ``device``)
    measure: str | None = None  # the first-use micro-measurement deciding it on this machine (``MEASUREMENTS``)


TABLE: dict[str, Tuned] = {
    "generation_backend": Tuned(
        value="compact", neutral="generate", device="cpu",
        tunes="the generation backend when generation_backend is unset",
        measured="bench/grpo.py --shape reasoning --threads 2 --steps 8 --warmup 2 --repeats 2 (small model, idle, "
                 "2026-11-24): compact 3.02-3.19 completions/s against generate 1.94 on the whole GRPO step; "
                 "docs/performance.md 'The reasoning workload at 2 threads, idle'",
        read_by="modules/sampling/choice.py (the default backend)",
        holds="counted, not timed: compact samples the same tokens as generate (tests/sampling) and runs each decode "
              "step on the rows still generating only, so it never does more matrix work than generate; its one "
              "kernel-dependent part, prepacked linears, is decided on this machine ('prepack' measurement)"),
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
        read_by="modules/sampling/compact.py (compact_groups)",
        holds="counted, not timed: the same attention on the same keys either way, and a decode step that "
              "torch.cat-copies every layer's cache copies O(length) bytes per token where the grown cache writes "
              "the new token only (32 rows of the small model to 256 tokens: ~20 GiB copied against ~0.1 GiB); "
              "copying is memory traffic, which the CPU's vector kernels do not change"),
    "compact_prepack_linears": Tuned(
        value=True, neutral=False, device="cpu",
        tunes="compact backend: plain float32 nn.Linear layers run on oneDNN-prepacked weights while sampling "
              "(packed_linears)",
        measured="GRPO generation, small model, 2 threads, idle (2026-11-24): 2.32 -> 1.86 ms per completion token "
                 "(1.25x), the same tokens in 5 of 5 seeded rollouts; docs/performance.md 'Prepacked linears'",
        read_by="modules/sampling/compact.py (compact_groups)",
        measure="prepack"),
    "compact_prepack_min_mib": Tuned(
        value=116, neutral=None, device="cpu",
        tunes="compact backend: the linears are prepacked only when a model's eligible linear weights hold at least "
              "this many MiB (the reorder of every weight at each rollout and oneDNN's per-call cost are a loss on "
              "small matrices)",
        measured="the sampling call alone, 8 prompts x 2 completions, 2 threads, idle (2026-11-26): the tiny model "
                 "(3.9 MiB of linear weights) 85.8 ms prepacked vs 53.7 ms plain for 8 new tokens, 273.8 vs 224.3 ms "
                 "for 32; the small model (116 MiB) gains 1.25x (compact_prepack_linears). Sizes between the two "
                 "were not measured: they stay unpacked; docs/performance.md 'Prepacked linears'",
        read_by="modules/sampling/compact.py (compact_groups)",
        measure="prepack"),
    "distill_padding_free": Tuned(
        value=True, neutral=False, device="cpu",
        tunes="DistillModule: padding_free when it is unset (rows packed into one, no padding through the student "
              "and the teacher), where both models run it exactly",
        measured="bench/distill.py --steps 10-20 --repeats 2, tiny student / small teacher, 2 threads, idle "
                 "(2026-11-26, session 18): english rows 2.67 -> 4.37 steps/s (1.64x), arithmetic rows 6.06 -> 7.31 "
                 "(1.21x); docs/distill.md 'Speed and memory against TRL'",
        read_by="modules/distill.py (DistillModule.resolve_padding_free)",
        holds="counted, not timed: a padding-free row computes no padding tokens through either model, the same "
              "numbers where both run it exactly (the layout probe decides that); how its attention is split is "
              "decided on this machine ('split_packed' measurement)"),
    "packed_linear_rows_hint": Tuned(
        value=32, neutral=None, device="cpu",
        tunes="the batch size oneDNN's prepacked weight layout is chosen for",
        measured="python bench/packed_linear.py (the small model's 24 MLP matrices, 1-2 threads): hints 8 and 32 "
                 "measured the same from 1 to 32 rows; docs/performance.md 'Prepacked linears'",
        read_by="modules/sampling/packed_linear.py (packed_linears)",
        holds="a layout hint read only where weights are packed, which the first-use 'prepack' measurement "
              "decides with this hint (8 and 32 measured the same)"),
    "static_prompt_bucket": Tuned(
        value=32, neutral=1, device="cpu",
        tunes="static backend: prompts are left-padded to a multiple of this many tokens so rollouts reuse the "
              "compiled decode graph (neutral 1: no padding, a graph per prompt width)",
        measured="not a timed figure: chosen with the static backend (2026-11-23) because inductor's first "
                 "compilation of the decode step took about 4 minutes on the tiny model on this machine; "
                 "docs/performance.md 'Generation backends on the reasoning workload'",
        read_by="modules/sampling/static.py (bucket_prompts)",
        holds="not a timing: it sets how many decode graphs are compiled (one per prompt-width bucket), a count the "
              "CPU's kernels do not change"),
    "min_saved_scores_per_call": Tuned(
        value=32768, neutral=None, device="cpu",
        tunes="shared-prefix rows (DPO pairs, GRPO groups) under sdpa_varlen: one SDPA call per segment when each "
              "call saves at least this many query-key scores (None: one masked call per row)",
        measured="forward+backward of shared-prefix DPO rows (2026-11-22): short chat pairs (~26-token segments, ~5k "
                 "scores saved per call) 7% faster unsplit, long-tailed pairs (~150-token segments, 42k-62k saved "
                 "per call) 7% faster split; break-even near 30k (commit 4f9e3ca)",
        read_by="modules/adaptations/attention.py (worth_splitting)",
        measure="split_segments"),
    "split_packed_sequences": Tuned(
        value=True, neutral=None, device="cpu",
        tunes="padding-free rows under sdpa_varlen: one causal SDPA call per packed sequence (None: only where the "
              "model's own sdpa mask would let packed sequences mix, as measured on its probe)",
        measured="SFT on packed rows: one [T, T] masked SDPA call per row was about 30% of a step at 8 sequences of "
                 "~140 tokens (modules/adaptations/attention.py's note; no benchmark figure of the split alone)",
        read_by="modules/adaptations/layouts.py (split_packed_attention)",
        measure="split_packed"),
    "bf16_attention_fp32_max_tokens": Tuned(
        value=384, neutral=None, device="cpu",
        tunes="bf16-mixed runs on the CPU: sdpa_varlen's attention computed in float32 (autocast off, inputs upcast "
              "exactly) for rows of at most this many keys (None: autocast's bf16 attention)",
        measured="forward+backward of one causal SDPA call, 8 heads of 64, 1 thread, torch 2.13.0, AMX CPU "
                 "(2026-11-29), float32 against bf16 ms: 8 rows x 64 tokens 8.7 / 23.0, 8x128 23.1 / 48.5, 4x256 "
                 "32.9 / 37.6, 2x384 33.2 / 35.0, 2x512 61.7 / 52.8, 1x1024 110 / 91, 1x2048 445 / 366; with AVX2 "
                 "kernels (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2) bf16 is 4.7-9x slower at every "
                 "length; docs/performance.md 'bf16 attention'",
        read_by="modules/adaptations/attention.py (_attend)",
        machine=MEASURED_ON.replace("float32, 2 threads", "bf16 (AVX-512 BF16, AMX), 1 thread"),
        measure="bf16_attention"),
    "onednn_primitive_cache_capacity": Tuned(
        value=32, neutral=None, device="cpu",
        tunes="bf16 runs: the capacity of oneDNN's and ideep's primitive caches (ONEDNN_PRIMITIVE_CACHE_CAPACITY, "
              "LRU_CACHE_CAPACITY) where the environment sets neither (None: the libraries' 1024 each)",
        measured="SFT, small model, chat rows, batch 8, max_length 256, padding-free, 40 steps, 1 thread, on an AMX "
                 "CPU (2026-11-29): peak RSS 1,745 MiB at the default 1024 (still growing, fp32 1,252), 1,474 at 128, "
                 "1,362 at 64, 1,285-1,297 at 32 (flat after step 4); 787 primitives built at 32 and 64 against 569 at "
                 "1024 (8.1 s against 4.9 s of building in 40 steps); docs/performance.md 'bf16 on CPU'",
        read_by="modules/training/cpu_bf16.py (bound_onednn_caches, at setup of a bf16 CPU run)",
        machine=MEASURED_ON.replace("float32, 2 threads", "bf16 (AVX-512 BF16, AMX), 1 thread"),
        holds="a bound on memory, not a timing: a primitive rebuilt after eviction is the same kernel for the same "
              "shape, so results are unchanged on any CPU, and only a CPU whose bf16 products go through oneDNN keeps "
              "primitives at all"),
    "retain_freed_cpu_memory_bytes": Tuned(
        value=1 << 30, neutral=None, device="cpu",
        tunes="retain_cpu_memory: glibc's mmap and trim thresholds while a PolicyModule runs on this device "
              "(None: the allocator is left alone)",
        measured="bench/dpo.py --frameworks lightalign --repeats 2 --retain-cpu-memory off|on (chat DPO, "
                 "2026-11-23): 23.2 -> 26.6 pairs/s online (+14%), 30.0 -> 33.9 precomputed (+13%), peak RSS "
                 "unchanged; padded SFT within noise; docs/performance.md 'retain_cpu_memory'",
        read_by="modules/training/side_effects.py (ScopedSideEffects.apply, at setup) through "
                "modules/training/acceleration.py",
        holds="not a kernel timing: the gain is the page faults and munmap calls of large blocks glibc no longer "
              "returns to the kernel between steps, the same count on any x86-64 CPU for the same allocations"),
}


def _device_type(device: str | torch.device) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def _entry(name: str) -> Tuned:
    try:
        return TABLE[name]
    except KeyError:
        raise KeyError(f"no tuned constant {name!r}; the table has {sorted(TABLE)}") from None


def mode() -> str:
    """``LIGHTALIGN_TUNING``: ``measure`` (default), ``table`` or ``neutral`` (the module docstring)."""
    chosen = os.environ.get("LIGHTALIGN_TUNING") or "measure"
    if chosen not in MODES:
        raise ValueError(f"LIGHTALIGN_TUNING={chosen!r} is not one of {', '.join(MODES)}: 'measure' decides each "
                         "tuned constant on this machine, 'table' takes the table's values, 'neutral' none.")
    return chosen


# ------------------------------------------------------------------------------------ verdicts of this machine
_files: dict[str, dict] = {}  # cache file -> its content, read once per process
measured_here: set[str] = set()  # measurements this process ran (the rest of its verdicts came from the cache)


def cache_file(key: dict) -> Path:
    """Where the verdicts of the machine ``key`` live: beside the layout probe's (``LIGHTALIGN_CACHE_DIR``)."""
    return cache_root() / "tuning" / f"{key_id(key)}.json"


def _disk_cache() -> bool:
    return os.environ.get("LIGHTALIGN_PROBE_CACHE", "1") != "0"


def _verdicts(key: dict) -> tuple[Path, dict]:
    path = cache_file(key)
    if str(path) not in _files:
        data: dict = {}
        if _disk_cache():
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                data = {}  # none yet (or unreadable): measured again and rewritten
        if data.get("key") != key:
            data = {"key": key, "measured": {}, "recorded": {}}
        _files[str(path)] = data
    return path, _files[str(path)]


def _save(path: Path, data: dict) -> None:
    if not _disk_cache():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(data, f, sort_keys=True)
        os.replace(f.name, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # a read-only cache only costs the next process another measurement


def _measured(measurement: str, key: dict) -> tuple[bool, str]:
    """(whether the tuned value wins ``measurement`` on this machine, "measured" or "cached")."""
    path, data = _verdicts(key)
    if measurement in data["measured"]:
        return bool(data["measured"][measurement]), "measured" if measurement in measured_here else "cached"
    from lightalign.modules.training.tuning_measurements import MEASUREMENTS

    # its own tensors and generator; gradients on even when the first reader runs under no_grad; no autocast
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad(), \
            torch.autocast("cpu", enabled=False):
        verdict = bool(MEASUREMENTS[measurement](TABLE))
    measured_here.add(measurement)
    data["measured"][measurement] = verdict
    _save(path, data)
    return verdict, "measured"


def record(name: str, value: Any) -> None:
    """Record ``value`` as constant ``name``'s verdict for this machine (its key), e.g. after running the benchmark
    its ``measured`` names here: entries decided by a whole benchmark apply then, read from the cache."""
    entry = _entry(name)
    if entry.holds or entry.measure:
        raise ValueError(f"{name!r} is not decided by a recorded benchmark (it "
                         f"{'holds on any CPU' if entry.holds else 'is measured at first use'}).")
    path, data = _verdicts(machine_key())
    data["recorded"][name] = value
    _save(path, data)


def resolve(name: str, device: str | torch.device) -> tuple[Any, str]:
    """(constant ``name`` for a run on ``device``, where the value comes from): "other device" (neutral),
    "table" / "neutral" (``LIGHTALIGN_TUNING``), "recorded key" (measured under this machine's key), "holds" (right on
    any CPU), "measured" / "cached" (a first-use measurement, now or earlier; its verdict may be the neutral value),
    "recorded" (``record``), "untuned" (this CPU differs from the one measured: neutral)."""
    entry = _entry(name)
    if _device_type(device) != entry.device:
        return entry.neutral, "other device"
    chosen = mode()
    if chosen != "measure":
        return (entry.value if chosen == "table" else entry.neutral), chosen
    key = machine_key()
    if entry.key is not None and entry.key == key:
        return entry.value, "recorded key"
    if entry.holds:
        return entry.value, "holds"
    if entry.measure is not None:
        wins, source = _measured(entry.measure, key)
        return (entry.value if wins else entry.neutral), source
    recorded = _verdicts(key)[1]["recorded"]
    if name in recorded:
        return recorded[name], "recorded"
    return entry.neutral, "untuned"


def tuned(name: str, device: str | torch.device) -> Any:
    """The constant ``name`` for a run on ``device`` (a ``torch.device`` or a name such as ``"cpu"``,
    ``"cuda:0"``): its measured value where it applies on this machine (``resolve``), its neutral value elsewhere."""
    return resolve(name, device)[0]


def tuning_note(device: str | torch.device) -> str:
    """The fit-start line's clause: whether the tuned constants apply on this machine, and how. Decides every
    entry of ``device``'s type (a first use on a CPU runs its micro-measurements here, about a second)."""
    kind = _device_type(device)
    names = [name for name, entry in TABLE.items() if entry.device == kind]
    chosen = mode()
    if not names:
        return f"tuned constants: untuned defaults (none measured on {kind})"
    if chosen != "measure":
        return f"tuned constants: {'the table' if chosen == 'table' else 'untuned defaults'} (LIGHTALIGN_TUNING={chosen})"
    by: dict[str, list[str]] = {}
    for name in names:
        value, source = resolve(name, device)
        lost = source in ("measured", "cached") and value == TABLE[name].neutral
        by.setdefault(source + (" lost" if lost else ""), []).append(name)
    parts = []
    for source, words in (("recorded key", "measured on this CPU's key"), ("holds", "hold on any CPU"),
                          ("measured", "measured here at first use"), ("cached", "cached from a first-use measurement"),
                          ("recorded", "recorded for this CPU")):
        if source in by or source + " lost" in by:
            lost = by.get(source + " lost", [])
            parts.append(f"{len(by.get(source, [])) + len(lost)} {words}"
                         + (f" ({', '.join(lost)} slower here: untuned)" if lost else ""))
    if "untuned" in by:
        parts.append(f"untuned defaults for {', '.join(by['untuned'])}: this CPU differs from the one measured")
    return "tuned constants: " + "; ".join(parts)
