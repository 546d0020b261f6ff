"""The CLI end to end, in subprocesses, as users run it."""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import pytest

from helpers import console_script
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow


def run_cli(repo: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = console_script.run(repo, *args, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-5000:]}"
    return proc


def read_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    with open(run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in ("", None):
                    out.setdefault(key, []).append((int(row["step"]), float(value)))
    return out


def test_quickstart_end_to_end(repo, tmp_path):
    proc = run_cli(repo, "fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "60",
                   "--trainer.val_check_interval", "30", "--trainer.logger.init_args.save_dir", str(tmp_path))
    run_dir = tmp_path / "quickstart" / "version_0"
    metrics = read_metrics(run_dir)
    losses = [v for _, v in metrics["train/loss"]]
    assert len(losses) == 60  # once per optimizer step
    assert sum(losses[-10:]) / 10 < losses[0] - 2.0  # from ~7 (uniform over 1024 tokens) to well below
    assert len(metrics["val/loss"]) == 2 and metrics["val/loss"][-1][1] < metrics["val/loss"][0][1] + 1e-6
    assert "train/tokens_per_sec" in metrics and "train/token_accuracy" in metrics
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert (run_dir / "config.yaml").exists() and (run_dir / "versions.json").exists()
    assert (run_dir / "curves.png").exists()  # plot.enabled in the quickstart config
    assert "lightalign run summary" in proc.stdout
    # the Hugging Face export loads with the plain transformers API and generates
    hf = run_dir / "hf_model"
    assert f"Hugging Face model written to {hf.relative_to(repo) if hf.is_relative_to(repo) else hf}" in proc.stdout + proc.stderr
    model = AutoModelForCausalLM.from_pretrained(hf)
    tok = AutoTokenizer.from_pretrained(hf)
    inputs = tok("12+7=", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    completion = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert completion and all(c.isdigit() for c in completion.strip()), completion  # learned the answer format


def test_print_config_resolves_everything(repo):
    proc = run_cli(repo, "fit", "--config", "configs/quickstart.yaml", "--print_config")
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["model"]["class_path"] == "lightalign.SFTModule"
    assert cfg["model"]["init_args"]["learning_rate"] == 3e-3
    assert cfg["data"]["init_args"]["max_length"] == 64
    assert cfg["checkpoint"]["save_last"] is True
    assert "export" in cfg and "trainer" in cfg


def _help(capsys, *args: str) -> str:
    """The CLI's help text, in-process (the help pages need no run; a subprocess each cost ~12 s of imports)."""
    from lightalign.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_documents_knobs(capsys):
    general = _help(capsys, "fit", "--help")
    for knob in ("--model.help lightalign.SFTModule", "--trainer.accumulate_grad_batches", "--trainer.precision", "--export.merge_lora",
                 "--checkpoint.every_n_train_steps", "--model.help", "--data.help"):
        assert knob in general, knob
    module = _help(capsys, "fit", "--model.help", "lightalign.SFTModule")
    for knob in ("model_name_or_path", "peft_config", "learning_rate", "lr_scheduler_type", "gradient_checkpointing",
                 "model_init_kwargs", "optimizer"):
        assert f"--model.{knob}" in module, knob
    data = _help(capsys, "fit", "--data.help", "lightalign.SFTDataModule")
    for knob in ("path", "max_length", "truncation_mode", "packing", "completion_only_loss", "assistant_only_loss"):
        assert f"--data.{knob}" in data, knob


def test_sft_template_on_a_local_pretrained_folder(repo, tmp_path, tiny_model, tokenizer):
    """configs/sft.yaml with a real (saved, pretrained-format) model folder and a data file, as the README says."""
    folder = tmp_path / "my-model"
    tiny_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = tmp_path / "train.jsonl"
    rows.write_text((repo / "examples" / "data" / "chat_sft.jsonl").read_text())
    run_cli(repo, "fit", "--config", "configs/sft.yaml",
            "--model.model_name_or_path", str(folder), "--data.path", str(rows),
            "--trainer.max_steps", "2", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
            "--data.num_workers", "0", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"))
    run_dir = tmp_path / "runs" / "sft" / "version_0"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["data"]["init_args"]["path"] == str(rows)
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model")
    assert exported.dtype == torch.bfloat16  # model_init_kwargs.dtype from the template
    assert not torch.equal(exported.model.embed_tokens.weight.float(), tiny_model.model.embed_tokens.weight.bfloat16().float())


def test_python_api_example_runs(repo, tmp_path):
    # `python examples/sft_python.py ...` in tmp_path, forked from the console server (tests/helpers/console_script.py:
    # run as __main__ with the script's sys.argv and sys.path[0], offline, torch and transformers already imported).
    # It writes the quickstart's files into its run folder (tests/training/test_trainer.py compares them with the
    # console's) and generates from the export.
    proc = console_script.run_python(repo / "examples" / "sft_python.py", "--max-steps", "5", cwd=tmp_path,
                                     timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "python-quickstart" / "version_0"
    for name in ("metrics.csv", "versions.json", "curves.png", "checkpoints/last.ckpt", "hf_model/model.safetensors",
                 "hf_model/README.md"):
        assert (run / name).is_file(), name
    assert [step for step, _ in read_metrics(run)["train/loss"]] == [0, 1, 2, 3, 4]
    assert [line.split(" ")[0] for line in proc.stdout.splitlines()[-3:]] == ["12+7=", "45-3=", "8+80="]


def test_dpo_tiny_config_end_to_end(repo, tmp_path):
    run_cli(repo, "fit", "--config", "configs/dpo_tiny.yaml", "--trainer.max_steps", "6",
            "--trainer.val_check_interval", "3", "--trainer.logger.init_args.save_dir", str(tmp_path))
    run_dir = tmp_path / "dpo_tiny" / "version_0"
    metrics = read_metrics(run_dir)
    for key in ("train/loss", "train/rewards/chosen", "train/rewards/rejected", "train/rewards/accuracies",
                "train/rewards/margins", "train/logps/chosen", "train/logps/rejected", "val/loss", "val/rewards/margins"):
        assert key in metrics, key
    assert len(metrics["train/loss"]) == 6
    assert AutoModelForCausalLM.from_pretrained(run_dir / "hf_model") is not None


def test_dpo_template_on_a_local_folder_with_precompute(repo, tmp_path, tiny_model, tokenizer):
    folder = tmp_path / "sft-model"
    tiny_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    run_cli(repo, "fit", "--config", "configs/dpo.yaml", "--model.model_name_or_path", str(folder),
            "--data.path", str(repo / "examples" / "data" / "chat_preference.jsonl"),
            "--model.precompute_ref_log_probs", "true", "--model.ref_log_probs_cache_dir", str(tmp_path / "cache"),
            "--trainer.max_steps", "2", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
            "--trainer.accumulate_grad_batches", "1", "--data.num_workers", "0",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"))
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 2  # train and validation reference log-probs
    assert (tmp_path / "runs" / "dpo" / "version_0" / "hf_model" / "model.safetensors").exists()


def test_grpo_quickstart_reward_rises(repo, tmp_path):
    run_cli(repo, "fit", "--config", "configs/grpo_quickstart.yaml", "--trainer.max_steps", "20",
            "--trainer.val_check_interval", "20", "--trainer.logger.init_args.save_dir", str(tmp_path))
    run_dir = tmp_path / "grpo_quickstart" / "version_0"
    rewards = [v for _, v in read_metrics(run_dir)["train/reward/mean"]]
    assert len(rewards) == 20
    assert rewards[0] < 0.1 and sum(rewards[-5:]) / 5 > rewards[0] + 0.4
    assert read_metrics(run_dir)["val/reward/mean"][-1][1] > 0.5
    assert (run_dir / "completions.csv").exists() and (run_dir / "hf_model" / "model.safetensors").exists()
    assert (run_dir / "curves.png").exists()


def test_grpo_template_on_a_local_folder(repo, tmp_path, tiny_model, tokenizer):
    folder = tmp_path / "policy"
    tiny_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    run_cli(repo, "fit", "--config", "configs/grpo.yaml", "--model.model_name_or_path", str(folder),
            "--data.path", str(repo / "examples" / "data" / "arithmetic_prompts.jsonl"),
            "--model.max_completion_length", "8", "--model.beta", "0.04", "--trainer.max_steps", "1",
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.limit_val_batches", "1",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"))
    metrics = read_metrics(tmp_path / "runs" / "grpo" / "version_0")
    assert "train/reward/accuracy_reward" in metrics and "train/kl" in metrics
