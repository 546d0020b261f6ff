"""The ``lightalign`` console script with tools: the shipped tool-calling GRPO config trains (on a policy that calls
the calculator) and logs whole trajectories; a wrong environment or tool import path is one line, before training."""

from __future__ import annotations

import csv
import json

import pytest

from helpers import console_script
from helpers.tool_policy import QUESTION

pytestmark = pytest.mark.slow
lightalign = console_script.expect


def tools_run(save_dir, *extra: str) -> list[str]:
    return ["fit", "--config", "configs/tools_grpo.yaml", "--trainer.max_steps", "2", "--trainer.limit_val_batches",
            "0", "--trainer.logger.init_args.save_dir", str(save_dir), "--model.init_args.num_generations", "4",
            "--model.init_args.generation_batch_size", "8", "--completions.every_n_steps", "1", *extra]


def test_tool_config_trains_and_logs_trajectories(repo, tmp_path, tool_policy_dir):
    """The shipped config, at its own temperature (1.0), on the fitted tool policy and the question it was fitted on:
    fit_tool_policy leaves every token of the path (call, then ``6``) at least 40 nats above any other, so every
    trajectory calls the calculator once and answers 6 unless a token leaves the path, which happens with
    probability below 1e-14 per token (tests/helpers/tool_policy.py)."""
    data = tmp_path / "prompts.jsonl"  # the question the policy was fitted to answer with a call
    data.write_text("".join(json.dumps({"prompt": QUESTION, "answer": "6"}) + "\n" for _ in range(20)))
    out = lightalign(repo, *tools_run(tmp_path, "--model.init_args.model_name_or_path", str(tool_policy_dir),
                                      "--data.init_args.path", str(data)))
    assert "step 2/2" in out and "Traceback" not in out
    run = tmp_path / "tools_grpo" / "version_0"
    with open(run / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/tools/call_frequency")]
    assert rows and all(float(r["train/tools/call_frequency"]) == 1.0 for r in rows)  # one call per trajectory
    assert all(float(r["train/reward/CalculatorEnv"]) == 1.0 for r in rows)  # the calls computed the answer
    with open(run / "completions.csv") as f:
        table = list(csv.DictReader(f))
    assert any("[tool calculate]" in r["completion"] and "[call {" in r["completion"] for r in table)


@pytest.mark.parametrize("knob, value, what", [
    ("environment_factory", "examples.agent.calculator.NoSuchEnv", "environment factory"),
    ("tools", "[examples.agent.calculator.nope]", "tool"),
])
def test_wrong_import_path_is_one_line_before_training(repo, tmp_path, knob, value, what):
    """A model folder that exists (the shipped config's is another run's export, absent from a fresh clone, and its
    refusal would come first)."""
    out = lightalign(repo, *tools_run(tmp_path, "--model.init_args.model_name_or_path", "assets/models/tiny",
                                      "--model.init_args.from_config", "true", f"--model.init_args.{knob}", value),
                     status=1)
    assert f"lightalign: error: Cannot import {what} '" in out and "Traceback" not in out
    assert not list(tmp_path.rglob("metrics.csv"))
