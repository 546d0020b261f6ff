"""modules/training/device_tuning.py: the constants measured on the project's CPU, in one table that names what each
tunes, how it was measured and where it applies; the code reads them for the device it runs on, so on the CPU every
value is the one used before the table (bit-identical numerics) and elsewhere the untuned behaviour. The tests run with
LIGHTALIGN_TUNING=table (conftest: the table's values on any CPU, nothing measured); the tests after the readers
decide the constants as a user's run does, on the machine key, with stand-in measurements."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import replace

import pytest
import torch

from helpers.tuning import set_tuned
from lightalign.modules.training.device_tuning import TABLE, tuned

# the values the code used before the table: on the CPU they must not change
BEFORE = {
    "generation_backend": "compact",
    "compact_fraction": 0.25,
    "compact_grow_cache": True,
    "compact_prepack_linears": True,
    "compact_prepack_min_mib": 116,  # (new in session 19: before it every model's linears were packed on the CPU)
    "distill_padding_free": True,  # (new in session 19: before it DistillModule's padding_free defaulted to false)
    "packed_linear_rows_hint": 32,
    "static_prompt_bucket": 32,
    "min_saved_scores_per_call": 32768,
    "split_packed_sequences": True,
    "retain_freed_cpu_memory_bytes": 1 << 30,
    "onednn_primitive_cache_capacity": 32,  # (new for issue #52: before it bf16 runs kept the libraries' 1024)
    "bf16_attention_fp32_max_tokens": 384,  # (new for issue #52: before it bf16 runs attended in bf16 at any length)
}


def test_every_entry_says_what_it_tunes_where_it_was_measured_and_keeps_the_cpu_value():
    assert set(TABLE) == set(BEFORE)
    for name, entry in TABLE.items():
        assert entry.device == "cpu" and entry.tunes and entry.measured and entry.read_by, name
        assert "2 cores" in entry.machine and "torch 2.13.0 CPU" in entry.machine, name
        assert tuned(name, "cpu") == tuned(name, torch.device("cpu")) == BEFORE[name], name
        assert entry.neutral != entry.value, name  # elsewhere the code runs untuned


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1), "mps", "meta", "xpu"])
def test_other_device_types_get_the_neutral_value(device):
    for name, entry in TABLE.items():
        assert tuned(name, device) == entry.neutral, name


def test_an_unknown_name_is_refused_naming_the_table():
    with pytest.raises(KeyError, match="no tuned constant 'nope'.*compact_fraction"):
        tuned("nope", "cpu")


# ------------------------------------------------------------------------------------------------ the readers
def test_static_buckets_prompts_by_the_prompts_device():
    """Mutation: bucket_prompts reading the CPU entry everywhere (or its old constant) -> the meta prompts are
    padded too; the CPU's own value not read from the table -> the override below does nothing."""
    from lightalign.modules.sampling.static import bucket_prompts

    ids, mask = torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    assert bucket_prompts(ids, mask, 0)[0].shape == (2, 32)
    assert bucket_prompts(ids.to("meta"), mask.to("meta"), 0)[0].shape == (2, 5)  # neutral: no padding


def test_static_reads_the_table_on_cpu(monkeypatch):
    from lightalign.modules.sampling.static import bucket_prompts

    set_tuned(monkeypatch, "static_prompt_bucket", 8)
    ids = torch.ones(1, 5, dtype=torch.long)
    assert bucket_prompts(ids, ids, 0)[0].shape == (1, 8)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_compact_takes_its_defaults_from_the_prompts_device(monkeypatch, device):
    """Unset knobs of compact_groups are the table's for the prompts' device type: on the CPU a quarter, the grown
    cache and the packed linears; elsewhere compaction at once and neither speed-up. Mutation: compact_groups
    defaulting to the CPU values (the old constants) -> the meta case fails."""
    from helpers.conformance_models import build
    from lightalign.modules.sampling import compact, packed_linear

    seen, packed = {}, []
    names = list(inspect.signature(compact._sample).parameters)
    monkeypatch.setattr(compact, "_sample", lambda *args: seen.update(zip(names, args)) or (None, None))
    real = packed_linear.packed_linears
    monkeypatch.setattr(packed_linear, "packed_linears", lambda model: packed.append(1) or real(model))
    prompts = torch.ones(1, 3, dtype=torch.long, device=device)
    compact.compact_groups(build("llama"), prompts, prompts, 2, eos_token_ids=[2], pad_token_id=0, max_new_tokens=4)
    knobs = (seen["compact_fraction"], seen["grow_cache"], len(packed))
    assert knobs == ((0.25, True, 0) if device == "cpu" else (0.0, False, 0))  # a tiny model: below the size
    set_tuned(monkeypatch, "compact_prepack_min_mib", 0)  # every size measured to gain: packed on the CPU
    compact.compact_groups(build("llama"), prompts, prompts, 2, eos_token_ids=[2], pad_token_id=0, max_new_tokens=4)
    assert len(packed) == (1 if device == "cpu" else 0)


def test_compact_packs_only_models_with_at_least_the_measured_linear_weights(monkeypatch):
    """The small model's 116 MiB of linear weights are packed, the same structure 1 MiB short of it is not.
    Mutation: the size check dropped -> the smaller one is packed, fails."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightalign.modules.sampling import compact, packed_linear

    packed = []
    monkeypatch.setattr(compact, "_sample", lambda *args: (None, None))
    monkeypatch.setattr(packed_linear, "packed_linears",
                        lambda model: packed.append(packed_linear.eligible_mib(model)) or contextlib.nullcontext())
    config = AutoConfig.from_pretrained("assets/models/small")
    small = AutoModelForCausalLM.from_config(config)
    config.intermediate_size -= 12  # 8 layers x 3 matrices x 12 x 512 x 4 bytes = 1.1 MiB less
    smaller = AutoModelForCausalLM.from_config(config)
    assert packed_linear.eligible_mib(small) == 116.0
    prompts = torch.ones(1, 3, dtype=torch.long)
    for model in (small, smaller):
        compact.compact_groups(model, prompts, prompts, 2, eos_token_ids=[2], pad_token_id=0, max_new_tokens=4)
    assert packed == [116.0]


def test_packed_linears_read_the_rows_hint_from_the_table(monkeypatch):
    """Mutation: packed_linears defaulting to the module constant -> the hint stays 32."""
    from lightalign.modules.sampling import packed_linear

    if not packed_linear.available():
        pytest.skip("oneDNN is not built in")
    hints = []
    real = packed_linear._PackedForward

    class Spy(real):
        def __init__(self, module, rows_hint):
            hints.append(rows_hint)
            super().__init__(module, rows_hint)

    monkeypatch.setattr(packed_linear, "_PackedForward", Spy)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with packed_linear.packed_linears(model) as n:
        assert n == 1
    set_tuned(monkeypatch, "packed_linear_rows_hint", 8)
    with packed_linear.packed_linears(model):
        pass
    assert hints == [32, 8]


# ------------------------------------------------------------------ the machine that runs (LIGHTALIGN_TUNING=measure)
UNRECORDED = {"compact_fraction"}  # decided by a whole benchmark


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """The default mode with a fresh cache and stand-in measurements (constructed verdicts, calls counted): no test
    asserts what a timing on this machine came out as."""
    from lightalign.modules.training import device_tuning, tuning_measurements

    monkeypatch.setenv("LIGHTALIGN_TUNING", "measure")
    monkeypatch.setenv("LIGHTALIGN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(device_tuning, "_files", {})
    monkeypatch.setattr(device_tuning, "measured_here", set())
    calls, verdicts = [], {"prepack": False, "split_packed": True, "split_segments": True, "bf16_attention": True}
    monkeypatch.setattr(tuning_measurements, "MEASUREMENTS",
                        {name: (lambda table, name=name: calls.append(name) or verdicts[name]) for name in verdicts})
    return calls, verdicts


def new_process(monkeypatch):
    """What a new process sees: nothing read or measured yet in memory, the disk cache kept."""
    from lightalign.modules.training import device_tuning

    monkeypatch.setattr(device_tuning, "_files", {})
    monkeypatch.setattr(device_tuning, "measured_here", set())


def test_every_entry_says_how_it_applies_on_a_cpu_other_than_the_one_measured():
    from lightalign.modules.training.tuning_measurements import MEASUREMENTS

    for name, entry in TABLE.items():
        assert entry.key is None and "were not recorded" in entry.machine, name  # the project's ISA: unknown
        assert not (entry.holds and entry.measure), name
        assert entry.measure is None or entry.measure in MEASUREMENTS, name
    assert {name for name, entry in TABLE.items() if not entry.holds and not entry.measure} == UNRECORDED


def test_a_machine_key_that_differs_gives_the_neutral_value_unless_a_verdict_is_recorded(measuring, monkeypatch):
    """Mutation: resolve ignoring the recorded key (the value on every CPU, as before) -> 0.25 on the other key,
    fails; record not read -> the last assertion fails."""
    from lightalign.modules.training import device_tuning
    from lightalign.modules.training.machine_key import machine_key

    here = machine_key()
    elsewhere = {**here, "cpu_capability": "AVX512" if here["cpu_capability"] != "AVX512" else "AVX2"}
    for key, expected in ((elsewhere, 0.0), (None, 0.0), (here, 0.25)):
        set_key = replace(TABLE["compact_fraction"], key=key)
        monkeypatch.setitem(device_tuning.TABLE, "compact_fraction", set_key)
        assert device_tuning.resolve("compact_fraction", "cpu")[0] == expected, key
    monkeypatch.setitem(device_tuning.TABLE, "compact_fraction", replace(set_key, key=elsewhere))
    device_tuning.record("compact_fraction", 0.25)  # e.g. after bench/generation.py on this machine
    new_process(monkeypatch)
    assert device_tuning.resolve("compact_fraction", "cpu") == (0.25, "recorded")
    assert measuring[0] == []  # nothing measured for it


def test_the_first_use_measurement_is_cached_and_reused(measuring, monkeypatch):
    """One measurement per verdict and machine, read back from disk by the next process, and not reused on another
    machine key. Mutations: the verdict not written (or not read) -> measured again; the cache file not keyed by
    the machine -> the other key reuses 'prepack: False'."""
    from lightalign.modules.training import device_tuning
    from lightalign.modules.training.machine_key import machine_key

    calls, verdicts = measuring
    assert tuned("compact_prepack_linears", "cpu") is False  # the stand-in says packing is slower here: neutral
    assert tuned("compact_prepack_min_mib", "cpu") is None  # the same verdict, not measured twice
    assert tuned("split_packed_sequences", "cpu") is True
    assert calls == ["prepack", "split_packed"]
    new_process(monkeypatch)
    assert device_tuning.resolve("compact_prepack_linears", "cpu") == (False, "cached")
    assert device_tuning.resolve("split_packed_sequences", torch.device("cpu")) == (True, "cached")
    assert calls == ["prepack", "split_packed"]
    other = {**machine_key(), "threads": machine_key()["threads"] + 1}
    monkeypatch.setattr(device_tuning, "machine_key", lambda: other)
    verdicts["prepack"] = True
    assert device_tuning.resolve("compact_prepack_linears", "cpu") == (True, "measured")
    assert calls == ["prepack", "split_packed", "prepack"]


def test_a_first_use_under_no_grad_measures_with_gradients(measuring, monkeypatch):
    """The first reader may be a sampling loop (no_grad) or a forward under autocast; the split measurements time a
    backward. Mutation: inference_mode(False) and enable_grad dropped from _measured -> the stand-in sees gradients
    off, fails."""
    from lightalign.modules.training import tuning_measurements

    seen = []
    monkeypatch.setitem(tuning_measurements.MEASUREMENTS, "split_segments",
                        lambda table: seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"))) or True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert tuned("min_saved_scores_per_call", "cpu") == 32768
    assert seen == [(True, False)]


def test_the_fit_start_clause_says_whether_the_tuned_constants_apply_here(measuring, monkeypatch):
    """Mutation: a cached verdict reported as measured now (or the reverse) -> the second clause fails; the untuned
    names left out -> the first fails."""
    from lightalign.modules.training.device_tuning import tuning_note

    first = tuning_note("cpu")
    assert first == ("tuned constants: 7 hold on any CPU; 5 measured here at first use (compact_prepack_linears, "
                     "compact_prepack_min_mib slower here: untuned); untuned defaults for compact_fraction: this CPU "
                     "differs from the one measured")
    new_process(monkeypatch)
    assert "5 cached from a first-use measurement (compact_prepack_linears" in tuning_note("cpu")
    assert tuning_note("cuda:0") == "tuned constants: untuned defaults (none measured on cuda)"
    monkeypatch.setenv("LIGHTALIGN_TUNING", "neutral")
    assert tuning_note("cpu") == "tuned constants: untuned defaults (LIGHTALIGN_TUNING=neutral)"
    assert all(tuned(name, "cpu") == entry.neutral for name, entry in TABLE.items())
    monkeypatch.setenv("LIGHTALIGN_TUNING", "fast")
    with pytest.raises(ValueError, match="LIGHTALIGN_TUNING='fast' is not one of measure, table, neutral"):
        tuned("compact_fraction", "cpu")


def test_the_verdict_is_the_median_of_alternating_repeats_on_constructed_timings(monkeypatch):
    """tuned_wins on a stand-in clock: the tuned side takes 1 s except one 9 s outlier, the neutral side 2 s.
    Mutation: the mean instead of the median -> the outlier makes the tuned side lose."""
    from lightalign.modules.training import tuning_measurements as tm

    clock = [0.0]
    monkeypatch.setattr(tm.time, "perf_counter", lambda: clock[0])
    tuned_times = iter([1.0, 9.0, 1.0, 1.0, 1.0, 1.0])  # warm-up, then 5 timed

    def tuned_side():
        clock[0] += next(tuned_times)

    def neutral_side():
        clock[0] += 2.0

    assert tm.tuned_wins(tuned_side, neutral_side, repeats=5) == (True, 1.0, 2.0)


def test_prepacking_counts_its_reorder_once_per_rollout(monkeypatch):
    """Constructed timings: packed calls 30 ms against 40 ms plain per sample of 16 tokens, and a reorder of 0.2 s
    (0.0125 s per 16 of a rollout's 256 tokens) -> packing loses; a reorder of 0.1 s -> it wins. Mutation: the
    reorder left out -> the first case wins, fails."""
    from lightalign.modules.sampling import packed_linear
    from lightalign.modules.training import tuning_measurements as tm

    if not packed_linear.available():
        pytest.skip("oneDNN is not built in")
    monkeypatch.setattr(tm, "tuned_wins", lambda packed, plain, repeats: (True, 0.030, 0.040))
    for reorder, wins in ((0.2, False), (0.1, True)):
        monkeypatch.setattr(tm, "_seconds", lambda run, reorder=reorder: reorder)
        assert tm.prepack(TABLE) is wins


def test_the_real_measurements_run_and_give_a_verdict():
    """Each measurement runs here (about a second in all on an idle core); its outcome is this machine's and is not
    asserted."""
    from lightalign.modules.training.tuning_measurements import MEASUREMENTS

    for name, measure in MEASUREMENTS.items():
        assert measure(TABLE) in (True, False), name
