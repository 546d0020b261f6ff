"""Start-up work the console script does not do needlessly: a config naming its method by import path
imports that method only (``PolicyModule.__subclasses__`` imports the others when jsonargparse lists the methods, so a
short class name still resolves).
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers import console_script

WORKER = Path(__file__).resolve().parents[1] / "workers" / "cli_method_imports.py"


def _built(repo: Path, config: Path) -> dict:
    proc = console_script.run_python(WORKER, str(config), cwd=repo, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_config_naming_its_method_by_path_imports_no_other_method_and_short_names_still_resolve(repo, tmp_path):
    """Mutations: the console script importing every method up front again (the loop over ``lightalign.__all__`` in
    ``LightalignCLI.__init__``) -> GRPO's module imported for a DPO config; ``PolicyModule.__subclasses__`` removed
    -> ``class_path: DPOModule`` does not resolve (exit status 1: no such class)."""
    by_path = _built(repo, repo / "configs" / "dpo_tiny.yaml")
    assert by_path["model"] == "DPOModule"
    assert "lightalign.modules.dpo" in by_path["imported"]
    assert not {"lightalign.modules.grpo", "lightalign.modules.rollout", "lightalign.modules.sft"} & set(
        by_path["imported"]), by_path["imported"]
    short = tmp_path / "dpo_short.yaml"
    short.write_text((repo / "configs" / "dpo_tiny.yaml").read_text().replace(
        "class_path: lightalign.DPOModule", "class_path: DPOModule"))
    by_name = _built(repo, short)
    assert by_name["model"] == "DPOModule"
    assert "lightalign.modules.grpo" in by_name["imported"]  # listing the methods imported them all

