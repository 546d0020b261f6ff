"""modules/training/device_tuning.py: the constants measured on the project's CPU, in one table that names what each
tunes, how it was measured and where it applies; the code reads them for the device it runs on, so on the CPU every
value is the one used before the table (bit-identical numerics) and elsewhere the untuned behaviour."""

from __future__ import annotations

import contextlib
import inspect

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
