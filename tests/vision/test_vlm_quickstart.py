"""The vision-language quickstart: ``configs/vlm_quickstart_sft.yaml`` then ``configs/vlm_quickstart_grpo.yaml`` from
its export, through the console script, a few steps each (the full demo's figures: docs/vlm.md, "Quickstart")."""

from __future__ import annotations

import csv

import pytest

pytest.importorskip("PIL")

from helpers import console_script  # noqa: E402


def _metrics(run):
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    return {k for row in rows for k, v in row.items() if v}, rows


def test_vlm_quickstart_sft_then_grpo_from_its_export(repo, tmp_path):
    """SFT (2 steps, validated before and after) exports a model with its processor that loads as a vision-language
    model; GRPO (1 step) starts from that export (``--model.model_name_or_path``, as the config's comment says) and
    samples with the images; both draw their curves. Mutations: the SFT export saving the tokenizer instead of the
    processor (``HFExport._tokenizer``) -> the export has no image processor and does not load; GRPO's rollout
    without the prompts' images (``assemble_rollout``) -> the forward refuses the image placeholders, the run fails."""
    env = console_script.standard_env()
    sft = console_script.run(repo, "fit", "--config", str(repo / "configs/vlm_quickstart_sft.yaml"),
                             "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.max_steps", "2",
                             "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
                             env=env, timeout=600)
    assert sft.returncode == 0, sft.stderr[-3000:]
    run = tmp_path / "vlm_quickstart_sft/version_0"
    keys, _ = _metrics(run)
    assert {"train/loss", "val/loss", "train/token_accuracy"} <= keys
    assert (run / "curves.png").exists()
    export = run / "hf_model"
    from transformers import AutoModelForImageTextToText

    from lightalign.vision import load_processor

    model = AutoModelForImageTextToText.from_pretrained(export)
    processor = load_processor(str(export), None)
    assert (type(model).__name__, type(processor).__name__) == ("Qwen2VLForConditionalGeneration", "Qwen2VLProcessor")

    grpo = console_script.run(repo, "fit", "--config", str(repo / "configs/vlm_quickstart_grpo.yaml"),
                              "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.max_steps", "1",
                              "--trainer.limit_val_batches", "0", "--model.model_name_or_path", str(export),
                              "--model.generation_batch_size", "8", "--export.enabled", "false",
                              env=env, timeout=600)
    assert grpo.returncode == 0, grpo.stderr[-3000:]
    keys, _ = _metrics(tmp_path / "vlm_quickstart_grpo/version_0")
    assert {"train/reward/mean", "train/loss"} <= keys
    assert "generation generate (the prompts have images" in grpo.stdout + grpo.stderr
    assert (tmp_path / "vlm_quickstart_grpo/version_0/curves.png").exists()
