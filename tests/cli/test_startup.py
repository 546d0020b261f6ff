"""What the console script imports before it has work to do: ``lightalign fit --help`` and a config error import
neither datasets nor pandas nor pyarrow (about a second of CPU), and datasets' progress bars are still turned off
when a run imports it later (lightalign/quiet.py). Lightning's inexact-resume warning is dropped for lightalign's
own datamodules only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import lightning as L
import pytest

from helpers import console_script

# Imported by a run once it reads data, never by --help or a refusal before that.
LAZY = ("datasets", "pandas", "pyarrow")

# One fresh interpreter (the console server has datasets imported already): the console script's main() on
# `fit --help` and on a config file with a misspelt key, then the modules it imported, then datasets imported inside
# console_quiet (the bars must be off) and after it (back on).
PROBE = r"""
import json, sys
from lightalign.cli import main
from lightalign.quiet import console_quiet
config, lazy = sys.argv[1], json.loads(sys.argv[2])
report = {}
for name, argv in (("help", ["fit", "--help"]), ("config", ["fit", "--config", config])):
    sys.argv = ["lightalign", *argv]  # as the console script is called
    try:
        report[name] = main()
    except SystemExit as stop:
        report[name] = stop.code
report["imported"] = sorted(m for m in lazy if m in sys.modules)
with console_quiet(progress_bars=False):
    from datasets.utils.tqdm import are_progress_bars_disabled
    report["bars_off_inside"] = are_progress_bars_disabled()
report["bars_off_after"] = are_progress_bars_disabled()
print("REPORT " + json.dumps(report))
"""


@pytest.mark.slow  # a fresh interpreter: one import of torch and Lightning
def test_help_and_a_config_error_import_no_data_library(repo, tmp_path):
    """Mutations: `from datasets import Dataset` back at the top of datamodules/sft.py, or quiet.py importing
    datasets.utils.tqdm at once -> "datasets" imported; AfterImport not calling back -> bars on inside the block."""
    config = tmp_path / "typo.yaml"
    config.write_text((repo / "configs" / "quickstart.yaml").read_text().replace("learning_rate:", "learning_rat:"))
    proc = subprocess.run([sys.executable, "-c", PROBE, str(config), json.dumps(LAZY)], cwd=repo, capture_output=True,
                          text=True, env=console_script.standard_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.rsplit("REPORT ", 1)[1])
    assert proc.stdout.startswith("usage: ") and "--model CONFIG" in proc.stdout
    error = proc.stderr.splitlines()[0]
    assert error == (f"lightalign: error: {config}, line 24: SFTModule has no option 'learning_rat'; did you mean "
                     "'learning_rate'?"), proc.stderr[-2000:]
    assert report == {"help": 0, "config": 2, "imported": [], "bars_off_inside": True, "bars_off_after": False}


class _OwnData(L.LightningDataModule):
    """A datamodule of the user's own: Lightning's warning may be true for it."""


@pytest.mark.parametrize("make, dropped", [
    (lambda: object.__new__(__import__("lightalign").SFTDataModule), True),
    (lambda: object.__new__(__import__("lightalign").PromptDataModule), True),
    (_OwnData, False),
])
def test_the_inexact_resume_warning_is_dropped_for_lightalign_datamodules_only(make, dropped):
    """Mutation: exact_resume_quiet ignoring the datamodule's class -> the user's datamodule loses the warning."""
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    from lightalign.quiet import exact_resume_quiet

    message = ("You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not "
               "resumable. This can cause unreliable results if further training is done.")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with exact_resume_quiet(make()):
            warnings.warn(message, PossibleUserWarning)
        warnings.warn(message, PossibleUserWarning)  # after the block: back
    assert [str(w.message) for w in seen] == [message] * (1 if dropped else 2)
