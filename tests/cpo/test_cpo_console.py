"""The shipped CPO and ORPO configs through the ``lightalign`` console script, and ``--model.help`` listing only the
knobs each method takes (no reference knob)."""

from __future__ import annotations

import csv

import pytest
from transformers import AutoModelForCausalLM

from helpers import console_script

pytestmark = pytest.mark.slow


def lightalign(repo, *args: str) -> str:
    proc = console_script.run(repo, *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-6000:]}"
    return out


@pytest.mark.parametrize("name, method, own", [
    ("cpo_tiny", "CPOModule", ("loss_type", "beta", "label_smoothing", "cpo_alpha", "simpo_gamma", "alpha")),
    ("orpo_tiny", "ORPOModule", ("beta",)),
])
def test_shipped_config_trains_validates_and_exports(repo, tmp_path, name, method, own):
    """Four steps, a validation at step 2 and 4: exit 0, TRL's statistics in metrics.csv, the export loads; the
    method's help lists its own knobs and no reference knob. Mutation: ``CPOModule`` taking ``ReferenceKnobs`` ->
    its help lists ``--model.ref_model_name_or_path`` and this fails."""
    lightalign(repo, "fit", "--config", f"configs/{name}.yaml", "--trainer.max_steps", "4",
               "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
               "--trainer.logger.init_args.save_dir", str(tmp_path), "--plot.enabled", "false")
    run_dir = tmp_path / name / "version_0"
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = {key for row in rows for key, value in row.items() if value not in ("", None)}
    expected = {"loss", "rewards/chosen", "rewards/accuracies", "rewards/margins", "logps/chosen", "nll_loss"}
    if method == "ORPOModule":
        expected |= {"log_odds_ratio", "log_odds_chosen"}
    missing = {f"{stage}/{key}" for stage in ("train", "val") for key in expected} - logged
    assert not missing, missing
    assert len([r for r in rows if r.get("train/loss")]) == 4
    assert AutoModelForCausalLM.from_pretrained(run_dir / "hf_model") is not None
    help_text = lightalign(repo, "fit", "--model.help", f"lightalign.{method}")
    assert all(f"--model.{knob} " in help_text for knob in own), help_text[-3000:]
    assert "ref_model" not in help_text and "precompute_ref" not in help_text
