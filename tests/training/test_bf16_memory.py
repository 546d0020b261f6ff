"""bf16 on the CPU, memory first: a bf16 run's oneDNN primitive caches are bounded (``bound_onednn_caches``), so
training on new matrix shapes step after step does not grow the process the way the libraries' default caches do;
the fit-start line names the precision and the CPU's native bf16."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import console_script
from lightalign.modules.training.cpu_bf16 import native_bf16, precision_note

WORKER = Path(__file__).resolve().parents[1] / "workers" / "bf16_memory_worker.py"
MiB = 1 << 20


def _growth(tiny_dir, precision: str, *flags: str, steps: int = 24) -> int:
    """Peak RSS after the last of ``steps`` steps minus after the first, in a forked worker process (bytes)."""
    proc = console_script.run_python(WORKER, str(tiny_dir), precision, str(steps), *flags, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["peak"] - out["first"]


def onednn_native_bf16() -> bool:
    """The CPU has native bf16 and oneDNN may use it (``ONEDNN_MAX_CPU_ISA``, e.g. the suite's ``AVX2`` run, can
    forbid it: oneDNN's emulated bf16 is then minutes for this test's steps)."""
    isa = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    return bool(native_bf16()) and torch.backends.mkldnn.is_available() and any(
        allowed in isa for allowed in ("ALL", "BF16", "AMX", "AVX10"))


@pytest.mark.skipif(not onednn_native_bf16(),
                    reason="bf16 products go through oneDNN's native per-shape primitives only on a CPU with native "
                           "bf16 that oneDNN is allowed to use")
def test_bf16_steps_on_new_shapes_keep_a_bounded_cache(tiny_dir):
    """Each step has new shapes (1000 + 7k rows), so oneDNN builds new primitives (kernels and buffers, about 1-9
    MiB each here) at every step: with the libraries' 1024-entry caches they are all kept, with the bound (32) the
    old ones are dropped. Measured on the project's AMX machine: at 24 steps 186 MiB bounded against 329 MiB unbounded
    (40 steps: 184 MB against 497 MB, float32 32 MB; the rest of the bounded growth is the heap's fragmentation and
    JIT code oneDNN does not hand back). Mutation: ``ScopedSideEffects.apply`` not calling ``bound_onednn_caches``
    -> 306 against 330 MiB, the test fails."""
    bounded = _growth(tiny_dir, "bf16-mixed")
    unbounded = _growth(tiny_dir, "bf16-mixed", "--library-default")
    assert unbounded > 64 * MiB, unbounded  # the control: new shapes do cost memory under the default caches
    assert bounded < 0.75 * unbounded, (bounded / MiB, unbounded / MiB)


def test_the_bound_is_set_on_the_cpu_only_and_a_users_value_wins(monkeypatch):
    """Mutation: bound_onednn_caches overwriting a set variable -> the user's 7 is lost."""
    from lightalign.modules.training.cpu_bf16 import CACHE_VARIABLES, bound_onednn_caches

    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert bound_onednn_caches(torch.device("cuda")) == {}
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    assert bound_onednn_caches(torch.device("cpu")) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32"}
    assert [os.environ[name] for name in CACHE_VARIABLES] == ["32", "7"]


@pytest.mark.parametrize("precision, flags, device, expected", [
    ("bf16-mixed", frozenset({"avx512_bf16", "amx_bf16"}), "cpu",
     "precision bf16-mixed (CPU AVX512, native bf16: AVX-512 BF16 + AMX-BF16; oneDNN caches "),
    ("32-true", frozenset({"avx2"}), "cpu", "precision 32-true (CPU AVX2, no native bf16 (emulated"),
    ("bf16-mixed", frozenset(), "cuda", "precision bf16-mixed"),
])
def test_the_precision_clause_names_the_precision_and_native_bf16(precision, flags, device, expected):
    capability = "AVX2" if "avx2" in flags else "AVX512"
    note = precision_note(precision, torch.device(device), flags=flags, capability=capability)
    assert note.startswith(expected) and (device == "cpu" or note == expected), note


def test_the_fit_start_line_says_the_precision(tiny_dir, data_dir, caplog, monkeypatch):
    """The real line of a bf16 CPU fit (the console's logger is Lightning's: rank_zero_info). Mutation:
    check_model_layout without precision_note -> no such clause."""
    import logging

    from lightalign.modules.training.cpu_bf16 import CACHE_VARIABLES

    for name in CACHE_VARIABLES:  # the fit's setup sets them: taken back after the test
        monkeypatch.delenv(name, raising=False)

    import lightning as L

    from lightalign import SFTDataModule, SFTModule

    module = SFTModule(str(tiny_dir), from_config=True)
    data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=2)
    with caplog.at_level(logging.INFO):
        L.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False).fit(module, data)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("lightalign adaptations"))
    native = native_bf16()
    assert "precision bf16-mixed (CPU " + torch.backends.cpu.get_cpu_capability() in line, line
    assert ("native bf16: " + " + ".join(native) if native else "no native bf16") in line, line
