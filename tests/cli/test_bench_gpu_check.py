"""The prepared GPU check (bench/gpu/run_check.py) cannot rot: its CPU dry run runs every section at tiny sizes
and reports each; a failing section is recorded with its traceback, the next ones still run and the exit status
says so; a section past its time box is killed; the wheels it carries are the versions the suite tests."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from pathlib import Path

import pytest

from helpers import console_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "run_check.py"
# Every section, in the order the check runs them (written out here: a section dropped from the script fails this).
SECTIONS = ["environment", "matmul_peak", "model", "padding_free_exactness", "sft", "trl_sft", "dpo", "trl_dpo", "grpo",
            "trl_grpo", "fsdp2", "sampler_generate", "sampler_compact", "sampler_continuous", "sampler_static",
            "sampler_vllm"]
OPTIONAL = {"trl_sft": "trl", "trl_dpo": "trl", "trl_grpo": "trl", "sampler_vllm": "vllm"}


def dry_run(out: Path, *args: str):
    proc = console_script.run_python(SCRIPT, "--dry-run", "--out", str(out), *args, cwd=ROOT, timeout=300)
    payload = json.loads((out / "gpu_check.json").read_text())
    return proc, payload


def test_the_dry_run_runs_and_reports_every_section(tmp_path):
    proc, payload = dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = payload["sections"]
    assert list(records) == SECTIONS
    for name, record in records.items():
        package = OPTIONAL.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            assert record["status"] == "skipped" and package in record["reason"].lower(), (name, record)
        else:
            assert record["status"] == "ok", (name, record)
    result = {name: record.get("result") or {} for name, record in records.items()}
    for name in ("sft", "dpo", "grpo", "fsdp2"):  # timed steps, a throughput and the FLOPs behind MFU
        assert result[name]["seconds"] > 0 and result[name]["tokens"] > 0 and 0 < result[name]["mfu_measured"], name
    exact = result["padding_free_exactness"]
    assert exact["exact"] and exact["leaking_control_diff"] > exact["tolerance"] > 0
    assert all(diff <= exact["tolerance"] for diff in exact["max_abs_diff"].values())
    for backend in ("generate", "compact", "continuous", "static"):
        assert result[f"sampler_{backend}"]["completion_tokens"] > 0, backend
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert all(re.search(rf"^\| {name} \| ", markdown, re.M) for name in SECTIONS)


def test_a_failing_section_is_recorded_the_next_runs_and_the_exit_status_says_so(tmp_path):
    # an invalid Lightning precision breaks the training sections; the sampler section does not read it
    proc, payload = dry_run(tmp_path, "--sections", "sft", "sampler_generate", "--precision", "not-a-precision")
    assert proc.returncode == 1, proc.stderr[-3000:]
    records = payload["sections"]
    assert list(records) == ["environment", "matmul_peak", "model", "sft", "sampler_generate"]
    assert records["sft"]["status"] == "failed" and "Traceback" in records["sft"]["error"]
    assert "not-a-precision" in records["sft"]["error"]
    assert records["sampler_generate"]["status"] == "ok"
    assert "FAILED sections: sft" in proc.stderr
    assert "### sft (failed)" in (tmp_path / "gpu_check.md").read_text()


def test_a_section_past_its_time_box_is_killed(tmp_path, monkeypatch):
    before = set(sys.modules)
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("gpu_run_check", SCRIPT)
        run_check = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(run_check)
    finally:
        sys.path.remove(str(SCRIPT.parent))
        for name in set(sys.modules) - before:  # the bench folders' plain module names (data, report, ...)
            if not name.startswith(("lightalign", "torch", "transformers", "lightning")):
                del sys.modules[name]
    monkeypatch.setitem(run_check.ALL, "slow", lambda ctx: time.sleep(120))
    (tmp_path / "results").mkdir()
    ctx = run_check.sections.Context(dry_run=True, device="cpu", workdir=tmp_path, sizes=run_check.workload.DRY,
                                     precision="32-true", seed=0)
    start = time.monotonic()
    ended = run_check.run_forked("slow", ctx, timeout=1.0)
    assert ended == "timeout after 1 s" and time.monotonic() - start < 30
    assert not (tmp_path / "results" / "slow.json").exists()


def test_the_carried_wheels_are_the_tested_versions():
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    pins = {name.lower().replace("_", "-"): version for name, version in pins.items()}
    carried = dict(line.split("==") for line in (ROOT / "bench" / "gpu" / "wheels.txt").read_text().splitlines()
                   if "==" in line and not line.startswith("#"))
    assert {"transformers", "datasets", "jsonargparse", "peft", "lightning", "torchmetrics", "trl"} <= set(carried)
    for name, version in carried.items():
        if name != "trl":  # TRL never enters the test environment
            assert pins[name.lower().replace("_", "-")] == version, name
    assert carried["trl"].startswith("1.16.")


@pytest.mark.parametrize("script", ["run.sh", "fetch_wheels.sh"])
def test_the_shell_scripts_parse(script):
    import subprocess

    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu" / script)]).returncode == 0
