"""retain_freed_cpu_memory: freed CPU memory is reused by the process instead of page-faulting in again, while a
module runs on the CPU (the device type its threshold was measured on); release_freed_cpu_memory undoes it at
teardown, also when the run raises."""

from __future__ import annotations

import platform
import subprocess
import sys

import lightning as L
import pytest
import torch

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt thresholds are a glibc setting")

# In a process that has imported what training imports, allocates, touches and frees a 64 MB tensor (above glibc's largest automatic mmap threshold, 32 MB) nine times
# and prints the minor page faults of the last eight rounds.
FAULTS = """
import resource, sys, torch
import lightalign.modules.sft  # what a training process has imported (Lightning, the method): its heap, not a bare one
from lightalign.modules.training.acceleration import retain_freed_cpu_memory
if sys.argv[1] == "retain":
    assert retain_freed_cpu_memory()
torch.set_num_threads(1)
def round_trip():
    t = torch.empty(16 * 1024 * 1024)
    t.fill_(1.0)
    del t
round_trip()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    round_trip()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_freed_memory_is_reused_without_page_faults():
    default, retained = _faults("default"), _faults("retain")
    # by default every round maps fresh pages (8 x 16384 faults of 4 KiB; fewer with transparent huge pages);
    # retained, the heap block is reused (here: one more fault-in of it in eight rounds, when a small allocation
    # took the front of the freed block)
    assert retained * 3 < default, (retained, default)


@glibc_only
def test_cpu_fit_sets_it_and_the_knob_turns_it_off(tiny_dir, data_dir):
    import lightning as L

    from lightalign import SFTDataModule, SFTModule

    seen = {}
    for retain in (False, True):
        module = SFTModule(str(tiny_dir), from_config=True, retain_cpu_memory=retain)
        data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4)
        L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(module, data)
        seen[retain] = module.cpu_memory_retained
    assert seen == {False: False, True: True}


# Whether a fresh block is served by mmap (glibc's mallinfo2 counts mapped blocks) with the thresholds set by
# retain_freed_cpu_memory (4 MiB), then after release_freed_cpu_memory (64 MiB: more than the heap top holds then, so
# glibc must either grow the heap or map the block; a free heap chunk would serve any size without either).
MAPPED = """
import ctypes
from lightalign.modules.training.acceleration import release_freed_cpu_memory, retain_freed_cpu_memory
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def mapped(size):
    before = libc.mallinfo2().hblks
    block = libc.malloc(size)
    after = libc.mallinfo2().hblks
    libc.free(block)
    return after > before
assert retain_freed_cpu_memory()
retained = mapped(4 << 20)
assert release_freed_cpu_memory()
print(retained, mapped(64 << 20))
"""


@glibc_only
def test_release_puts_the_thresholds_back():
    """Retained, a 4 MiB block comes from the heap; released, the thresholds are glibc's 128 KiB defaults again and
    a new block is mapped. Mutation: release_freed_cpu_memory not calling mallopt -> it comes from the heap."""
    import ctypes

    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("mallinfo2 needs glibc 2.33+")
    out = subprocess.run([sys.executable, "-c", MAPPED], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]


class FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, option: int, value: int) -> int:
        self.calls.append((option, value))
        return 1


@pytest.fixture
def libc(monkeypatch):
    """mallopt recorded instead of called; no holder outstanding; no allocator variables in the environment."""
    from lightalign.modules.training import acceleration

    fake = FakeLibc()
    monkeypatch.setattr(acceleration, "_libc", lambda: fake)
    monkeypatch.setattr(acceleration, "_holders", 0)
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    return fake


MMAP, TRIM = -3, -1
RETAIN = [(MMAP, 1 << 30), (TRIM, 1 << 30)]
UNDO = [(MMAP, 128 * 1024), (TRIM, 128 * 1024)]


class _Calls(L.Callback):
    def __init__(self, libc, fail=False) -> None:
        self.libc, self.fail, self.during = libc, fail, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.during = list(self.libc.calls)
        if self.fail:
            raise RuntimeError("boom")


def _fit(tiny_dir, data_dir, callback, **module_kw):
    from lightalign import SFTDataModule, SFTModule

    module = SFTModule(str(tiny_dir), from_config=True, **module_kw)
    data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4)
    L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[callback]).fit(module, data)
    return module


def test_a_cpu_fit_retains_while_it_trains_and_undoes_at_teardown(libc, tiny_dir, data_dir):
    """Mutation: PolicyModule.teardown not releasing -> the undo calls are missing."""
    calls = _Calls(libc)
    module = _fit(tiny_dir, data_dir, calls)
    assert calls.during == RETAIN and libc.calls == RETAIN + UNDO
    assert module.cpu_memory_retained and not module.side_effects.holds_cpu_memory


def test_a_fit_that_raises_still_undoes(libc, tiny_dir, data_dir):
    """Lightning skips the module's teardown when fit raises; the on_exception callback releases instead.
    Mutation: UndoSideEffectsOnError left out of configure_callbacks -> the undo calls are missing."""
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tiny_dir, data_dir, _Calls(libc, fail=True))
    assert libc.calls == RETAIN + UNDO


def test_the_knob_off_leaves_the_allocator_alone(libc, tiny_dir, data_dir):
    _fit(tiny_dir, data_dir, _Calls(libc), retain_cpu_memory=False)
    assert libc.calls == []


@pytest.mark.parametrize("device, expected", [("cpu", RETAIN), ("cuda", []), ("cuda:1", []), ("mps", [])])
def test_applied_only_on_the_device_type_it_was_measured_on(libc, tiny_dir, device, expected):
    """Mutation: setup reading the table for "cpu" instead of the trainer's device -> the GPU cases retain."""
    from types import SimpleNamespace

    from lightalign import SFTModule

    module = SFTModule(str(tiny_dir), from_config=True)
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), precision="32-true")
    module.setup("fit")
    module.setup("fit")  # a second setup does not take a second hold
    assert libc.calls == expected
    module.teardown("fit")
    module.teardown("fit")  # nor a second teardown a second undo
    assert libc.calls == expected + (UNDO if expected else [])


def test_the_last_holder_undoes_to_the_thresholds_the_process_started_with(libc, monkeypatch):
    """Two holders: the first release keeps the setting, the second puts back what the environment set (glibc read
    it at start-up) or glibc's defaults. Mutation: release ignoring the holder count -> the first release undoes."""
    from lightalign.modules.training.acceleration import release_freed_cpu_memory, retain_freed_cpu_memory

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.check=0:glibc.malloc.trim_threshold=0x40000")
    assert retain_freed_cpu_memory() and retain_freed_cpu_memory(1 << 20)
    assert libc.calls == RETAIN + [(MMAP, 1 << 20), (TRIM, 1 << 20)]
    assert not release_freed_cpu_memory()  # another holder keeps it
    assert len(libc.calls) == 4
    assert release_freed_cpu_memory()
    assert libc.calls[4:] == [(MMAP, 65536), (TRIM, 0x40000)]
    assert not release_freed_cpu_memory()  # nothing held
    assert len(libc.calls) == 6
