"""bf16 on the CPU, memory first: a bf16 run's oneDNN primitive caches are bounded (``bound_onednn_caches``), so
training on new matrix shapes step after step does not grow the process the way the libraries' default caches do;
a bf16-mixed fit keeps no second copy of the weights, between steps or for the backward pass
(``recast_saved_weights``, bitwise autocast's own backward); the fit-start line names the precision and the CPU's
native bf16."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
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


EXACTNESS = Path(__file__).resolve().parents[1] / "workers" / "recast_exactness_worker.py"


@pytest.mark.parametrize("kernels", ["this CPU's", "AVX2"])
def test_recast_weights_give_autocasts_outputs_and_gradients_bit_for_bit(kernels):
    """``recast_saved_weights`` (the bf16-mixed CPU path's saved-tensor hooks) against autocast's own backward on
    constructed linears, a tied and a viewed weight: outputs and gradients bitwise equal, on this CPU's kernels and
    (a fresh process) on AVX2 ones with oneDNN limited to AVX2; and the hooks did recast (12 saved casts). Mutations:
    the unpacked recast without the saved view's strides (``as_strided`` dropped) -> the run fails (shape mismatch);
    a recast through float16 (``.half()`` first) -> not equal."""
    if kernels == "AVX2":
        env = {**console_script.standard_env(), "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
        proc = console_script.run_python(EXACTNESS, env=env, timeout=300)  # not the server's env: a fresh process
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    else:
        spec = importlib.util.spec_from_file_location("recast_exactness_worker", EXACTNESS)
        worker = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(worker)
        out = worker.report()
    assert out["recasts"] == 12, out
    assert all(case["equal"] for case in out["cases"].values()), out
    assert kernels != "AVX2" or out["capability"] == "AVX2", out


def _fit_bytes(model_dir: Path, data_dir: Path, precision: str):
    """Live tensor bytes (``LiveTensorBytes``) of a 2-step SFT fit in ``precision`` and its parameter bytes."""
    import lightning as L

    from helpers.live_tensor_bytes import StepBytes
    from lightalign import SFTDataModule, SFTModule

    torch.manual_seed(0)
    module = SFTModule(str(model_dir), from_config=True)
    data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(model_dir), batch_size=2)
    steps = StepBytes()
    L.Trainer(accelerator="cpu", precision=precision, max_steps=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=[steps]).fit(module, data)
    return steps, sum(p.numel() * p.element_size() for p in module.parameters())


def test_a_bf16_fit_keeps_no_second_copy_of_the_weights(tiny_dir, data_dir, tmp_path, monkeypatch):
    """Live tensor bytes (counted op by op, not RSS) of a 2-step SFT fit of a model whose weights dominate (8.9 MB of
    float32 parameters; rows of about 10 tokens: the fp32 forward keeps 0.9 MB for its backward), bf16-mixed against
    32-true, P = the float32 parameter bytes. A second copy of the weights would be 0.5 P (bf16) or 1.0 P (float32).

    * between steps (each step's end) bf16 holds what fp32 holds (parameters and Adam's two moments, 3 P) within
      0.1 P: no bf16 copy of the weights survives a step;
    * the forward keeps for its backward at most fp32's + 0.125 P (a quarter of a bf16 copy): the weights' bf16
      casts are not among the saved tensors (``recast_saved_weights``; with autocast's saved casts it is 0.5 P more);
    * the second step's peak is at most fp32's + 0.25 P (half a bf16 copy): measured +0.12 P, an Adam temporary
      the size of the largest weight at the peak (the optimizer's update), not a copy.

    Mutations: ``recasts_weights`` returning False -> the forward keeps 5.06 MB against 0.89 MB, fails; Lightning's
    autocast with its cast cache on (``cache_enabled=True``; Lightning turns it off) and the fit inside an outer
    ``torch.autocast``, so the cache spans the steps -> 4.46 MB more between steps, fails; a callback keeping
    ``[p.to(bfloat16) ...]`` on the module at each step's end -> fails between steps; ``training_forward_context``
    keeping a float32 clone of the parameters from the first step on -> 8.92 MB more between steps, fails."""
    from lightalign.modules.training.cpu_bf16 import CACHE_VARIABLES

    for name in CACHE_VARIABLES:  # the bf16 fit's setup sets them: taken back after the test
        monkeypatch.delenv(name, raising=False)
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, layer_types=["full_attention"] * 2)
    (model_dir / "config.json").write_text(json.dumps(config))

    fp32, params = _fit_bytes(model_dir, data_dir, "32-true")
    bf16, _ = _fit_bytes(model_dir, data_dir, "bf16-mixed")
    held = [b - s for b, s in zip(fp32.before_backward, fp32.start)]
    assert max(held) < 0.125 * params, (held, params)  # the premise: the weights dominate
    for step in range(2):
        assert abs(bf16.end[step] - fp32.end[step]) < 0.1 * params, (step, bf16.end, fp32.end, params)
        bf16_held = bf16.before_backward[step] - bf16.start[step]
        assert bf16_held < held[step] + 0.125 * params, (step, bf16_held, held, params)
    assert bf16.peak[1] < fp32.peak[1] + 0.25 * params, (bf16.peak, fp32.peak, params)


@pytest.mark.parametrize("precision, device, compiled, expected", [
    ("bf16-mixed", "cpu", False, True), ("bf16-mixed", "cuda", False, False), ("bf16-true", "cpu", False, False),
    ("32-true", "cpu", False, False), ("bf16-mixed", "cpu", True, False),
])
def test_weights_are_recast_under_bf16_mixed_on_the_cpu_only(precision, device, compiled, expected):
    """Where it was measured bitwise equal (bf16-mixed, CPU), never on a compiled model. Mutation: the device
    clause dropped -> the CUDA case is recast."""
    from lightalign.modules.training.recast_weights import recasts_weights

    model = torch.nn.Linear(2, 2)
    if compiled:
        model._orig_mod = torch.nn.Linear(2, 2)  # what torch.compile's wrapper holds
    assert recasts_weights(precision, torch.device(device), model) is expected
