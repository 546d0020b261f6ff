"""retain_freed_cpu_memory: freed CPU memory is reused by the process instead of page-faulting in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt thresholds are a glibc setting")

# Allocates, touches and frees a 64 MB tensor (above glibc's largest automatic mmap threshold, 32 MB) nine times
# and prints the minor page faults of the last eight rounds.
FAULTS = """
import resource, sys, torch
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
