"""``lightalign fit --hub.*``: a push that cannot happen is refused in one line before training (no checkpoint is
written). The console script runs with the tests' standard environment (HF_HUB_OFFLINE=1); no network is used."""

from __future__ import annotations

import pytest

from helpers import console_script

pytestmark = pytest.mark.slow


def short_run(save_dir, *extra: str) -> list[str]:
    return ["fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "2", "--trainer.limit_val_batches",
            "0", "--plot.enabled", "false", "--trainer.logger.init_args.save_dir", str(save_dir), *extra]


@pytest.mark.parametrize("extra, names", [
    (("--hub.hub_model_id", "me/x"), "HF_HUB_OFFLINE=1 forbids every Hub call"),
    ((), "no repository to push to: set --hub.hub_model_id"),
])
def test_a_push_that_cannot_happen_is_one_error_before_training(repo, tmp_path, extra, names):
    out = console_script.expect(repo, *short_run(tmp_path, "--hub.push_to_hub", "true", *extra), status=1)
    errors = [line for line in out.splitlines() if line.startswith("lightalign: error:")]
    assert len(errors) == 1 and names in errors[0] and "Traceback" not in out
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("hf_model"))


def test_hub_knobs_are_offered_without_a_token_knob(repo):
    out = console_script.expect(repo, "fit", "--help")
    for knob in ("--hub.push_to_hub", "--hub.hub_model_id", "--hub.hub_strategy", "--hub.hub_private_repo",
                 "--hub.hub_revision", "--hub.hub_always_push"):
        assert knob in out
    assert "--hub.hub_token" not in out and "--hub.api" not in out
