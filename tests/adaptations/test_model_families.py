"""Other model families through the ``lightalign`` console script: a layout a model cannot run exactly is refused
at fit start (exit status 1, one clear message, no training step), a supported one trains, and the fit-start line
says what was adapted."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import console_script

from helpers.conformance_models import build

pytestmark = pytest.mark.slow


def model_folder(tmp_path: Path, family: str, tiny_dir: Path) -> Path:
    """A local model folder of ``family`` (tiny random weights, the shipped tokenizer), as a user would pass."""
    from lightalign.hub import load_tokenizer

    folder = tmp_path / family
    build(family).save_pretrained(folder)
    load_tokenizer(str(tiny_dir)).save_pretrained(folder)
    return folder


def fit(repo: Path, tmp_path: Path, config: str, *args: str) -> subprocess.CompletedProcess:
    return console_script.run(repo, "fit", "--config", config, "--trainer.max_steps", "3",
                              "--trainer.limit_val_batches", "0", "--trainer.logger.init_args.save_dir", str(tmp_path),
                              "--plot.enabled", "false", *args, timeout=600)


def test_alibi_model_with_prompt_sharing_is_refused_before_any_step(repo, tmp_path, tiny_dir):
    folder = model_folder(tmp_path, "bloom", tiny_dir)
    proc = fit(repo, tmp_path, "configs/dpo_tiny.yaml", "--model.model_name_or_path", str(folder))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "prompt_sharing (PreferenceDataModule" in out and "BloomForCausalLM" in out and "ALiBi" in out, out[-3000:]
    assert "data.prompt_sharing: false" in out
    assert "too many values to unpack" not in out
    assert not list(tmp_path.rglob("metrics.csv")) or "train/loss" not in "".join(
        p.read_text() for p in tmp_path.rglob("metrics.csv"))
    # the alternative it names works: the classic padded layout trains the same model
    proc = fit(repo, tmp_path, "configs/dpo_tiny.yaml", "--model.model_name_or_path", str(folder),
               "--data.prompt_sharing", "false")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "layout dpo_classic" in proc.stdout + proc.stderr


def test_sliding_window_model_trains_with_prompt_sharing_and_says_what_was_adapted(repo, tmp_path, tiny_dir):
    folder = model_folder(tmp_path, "mistral-sliding", tiny_dir)
    proc = fit(repo, tmp_path, "configs/dpo_tiny.yaml", "--model.model_name_or_path", str(folder))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    line = next(x for x in out.splitlines() if "lightalign adaptations:" in x)
    assert "model mistral" in line and "attention sdpa_varlen" in line and "layout dpo_shared" in line
    assert "sliding window 6 kept" in line
    assert "recompute_mlp_activation 2/2 MLPs" in line
    hparams = next(tmp_path.rglob("hparams.yaml")).read_text()
    assert "lightalign_adaptations" in hparams and "dpo_shared" in hparams


def test_packing_on_a_conv_hybrid_is_refused(repo, tmp_path, tiny_dir):
    """LFM2's conv layers mix the sequences of a packed row (measured): one line naming model, knob and fix."""
    folder = model_folder(tmp_path, "lfm2", tiny_dir)
    proc = fit(repo, tmp_path, "configs/quickstart.yaml", "--model.model_name_or_path", str(folder),
               "--data.packing", "true")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "packing (SFTDataModule)" in out and "Lfm2ForCausalLM" in out and "packing: false" in out, out[-3000:]
    assert "Traceback" not in out


def test_an_attention_the_family_lacks_is_named_with_the_fix(tmp_path, tiny_dir):
    """configs/sft.yaml asks for sdpa; Bloom has only eager: the error says which knob to change."""
    from lightalign.hub import load_causal_lm

    folder = model_folder(tmp_path, "bloom", tiny_dir)
    with pytest.raises(ValueError, match="attn_implementation 'sdpa'.*model_init_kwargs.attn_implementation to eager"):
        load_causal_lm(str(folder), from_config=True, init_kwargs={"attn_implementation": "sdpa"})
    assert load_causal_lm(str(folder), from_config=True, init_kwargs={"attn_implementation": "eager"}) is not None
