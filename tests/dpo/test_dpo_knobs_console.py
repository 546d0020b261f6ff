"""The DPO knobs of issue #22 as a user meets them through the ``lightalign`` console script: listed by
``--model.help`` / ``--data.help``, and a combination that cannot work stops the run before training, naming the
knob."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import console_script

pytestmark = pytest.mark.slow


def lightalign(repo: Path, *args: str, status: int = 0) -> str:
    proc = console_script.run(repo, *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, f"exit {proc.returncode} (expected {status})\n{out[-6000:]}"
    return out


def test_help_lists_the_knobs(repo):
    out = lightalign(repo, "fit", "--model.help", "lightalign.DPOModule")
    for knob in ("f_divergence_type", "f_alpha_divergence_coef", "use_weighting", "discopop_tau",
                 "precompute_ref_batch_size", "disable_dropout", "router_aux_loss_coef", "activation_offloading",
                 "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"):
        assert f"--model.{knob}" in out, knob
    assert "--data.padding_free" in lightalign(repo, "fit", "--data.help", "lightalign.PreferenceDataModule")


@pytest.mark.parametrize("extra, message", [
    (["--model.sync_ref_model", "true", "--model.precompute_ref_log_probs", "true"], "sync_ref_model=True cannot work"),
    (["--model.f_divergence_type", "js_divergence", "--model.loss_type", "bco_pair"],
     "f_divergence_type='js_divergence' does not apply"),
    (["--data.padding_free", "true"], "set prompt_sharing: false"),
])
def test_a_combination_that_cannot_work_fails_before_training_naming_the_knob(repo, tmp_path, extra, message):
    """Exit 1 with the knob's message, before any step (no metrics written). (Construction errors reach the user
    through jsonargparse's own report, as every module-argument error of the CLI does today.)"""
    out = lightalign(repo, "fit", "--config", "configs/dpo_tiny.yaml", "--trainer.max_steps", "1",
                     "--trainer.logger.init_args.save_dir", str(tmp_path), *extra, status=1)
    assert message in out, out[-3000:]
    assert not list(tmp_path.rglob("metrics.csv"))
