"""Trainer settings, the logger's folder, the model folder, the sampling knobs and the data a method cannot use:
refused in one line through the console script (#37), exit 1, no traceback, before the model loads, and that line
comes first (Lightning's "Seed set to 42" and "GPU available: ..." are held until the run starts: lightalign/quiet.py).

Lightning refuses an unknown strategy, a GPU that is not there and FSDP on CPU when it builds the Trainer (its
traceback, ~30 lines, was what a user saw); DeepSpeed on CPU and an unwritable logger folder failed only once
training started. Each case is a few seconds through the console server.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import console_script

QUICKSTART = ("fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "2")
GRPO = ("fit", "--config", "configs/grpo_quickstart.yaml", "--trainer.max_steps", "2")
DISTILL = ("fit", "--config", "configs/distill_quickstart.yaml", "--trainer.max_steps", "2")
ONLINE_DPO = ("fit", "--config", "configs/online_dpo_quickstart.yaml", "--trainer.max_steps", "2")
NO_CUDA = ("use_vllm: true needs a CUDA GPU (vLLM generates on GPUs) and this machine has none. On CPU leave "
           "use_vllm: false: completions are sampled with transformers (generation_backend).")

# (name, arguments, the start of the line after "lightalign: error: "); {tmp} is the test's folder
CASES = [
    ("unknown strategy", QUICKSTART + ("--trainer.strategy", "dpp"),
     "Lightning refused the trainer settings (--trainer.strategy dpp): "
     "You selected an invalid strategy name: `strategy='dpp'`."),
    ("gpu without a GPU", QUICKSTART + ("--trainer.accelerator", "gpu"),
     "Lightning refused the trainer settings (--trainer.accelerator gpu, --trainer.devices 1): no GPU is visible here "
     "(torch.cuda.is_available() is False). Use --trainer.accelerator cpu"),
    ("fsdp on cpu", QUICKSTART + ("--trainer.strategy", "fsdp"),
     "Lightning refused the trainer settings (--trainer.accelerator cpu, --trainer.strategy fsdp): "
     "The strategy `fsdp` requires a GPU accelerator"),
    ("deepspeed on cpu", QUICKSTART + ("--trainer.strategy", "deepspeed_stage_2"),
     "--trainer.strategy asks for DeepSpeed, which runs on CUDA GPUs only, and the accelerator here is CPUAccelerator."),
    ("unwritable logger folder", QUICKSTART + ("--trainer.logger.init_args.save_dir", "{tmp}/file/runs"),
     "The logger's folder '{tmp}/file/runs' cannot be written (Not a directory)"),
    ("missing model folder", QUICKSTART + ("--model.model_name_or_path", "{tmp}/no-such-model"),
     "model_name_or_path: model folder '{tmp}/no-such-model' does not exist"),
    ("negative temperature", GRPO + ("--model.temperature", "-1"),
     "temperature must be > 0 (the rollout always samples; the loss divides the logits by it), got -1.0."),
    ("zero completion length", GRPO + ("--model.max_completion_length", "0"),
     "max_completion_length must be >= 1, got 0."),
    ("distill use_vllm without a GPU", DISTILL + ("--model.use_vllm", "true"), NO_CUDA),
    ("online dpo use_vllm without a GPU", ONLINE_DPO + ("--model.use_vllm", "true"), NO_CUDA),
    # the module's own check of the data (its setup, after the callbacks'): still the first line
    ("distill prompt-only data with lmbda 0", DISTILL + ("--model.teacher_model_name_or_path", "assets/models/tiny",
                                                         "--model.lmbda", "0", "--data.path", "{tmp}/prompts.jsonl"),
     "lmbda is 0.0 and seq_kd is false, so 100% of the batches train on the data's completions, but the training data "
     "has no 'completion' column (it has ['prompt'])."),
    ("a row without its column", DISTILL + ("--model.teacher_model_name_or_path", "assets/models/tiny", "--data.path",
                                            "{tmp}/chats.jsonl", "--data.val_split_size", "0"),
     "train data '{tmp}/chats.jsonl', line 9: row 7 has no column 'messages' (its columns: text): every row of "
     "conversational data needs its conversation there"),
    ("online dpo with reward_funcs and a judge", ONLINE_DPO + ("--model.judge", "my_module.my_judge"),
     "OnlineDPOModule ranks each pair of completions by reward_funcs or by a pairwise judge: give exactly one of them "
     "(got both: set --model.reward_funcs null to use the judge, or --model.judge null to use the reward functions)."),
]
CHAT = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}


@pytest.mark.slow
@pytest.mark.parametrize("name, args, expected", CASES, ids=[c[0] for c in CASES])
def test_console_refusals_are_one_line(repo, tmp_path, name, args, expected):
    if "without a GPU" in name and torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    (tmp_path / "file").write_text("a file where a folder is expected\n")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(40)))
    chats = [CHAT] * 7 + [{"text": "1+1=2"}] + [CHAT] * 8  # row 7 (line 9: after a blank line) has no messages
    (tmp_path / "chats.jsonl").write_text("\n" + "".join(json.dumps(row) + "\n" for row in chats))
    args = [a.format(tmp=tmp_path) for a in args]
    if not any(a == "--trainer.logger.init_args.save_dir" for a in args):
        args += ["--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    proc = console_script.run(repo, *args, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("lightalign: error:")]
    assert len(errors) == 1 and "Traceback" not in out, out[-4000:]
    assert errors[0].startswith(f"lightalign: error: {expected.format(tmp=tmp_path)}"), errors[0]
    assert out.splitlines()[0] == errors[0], out[:2000]  # nothing before it (no "Seed set to 42")
    assert "Tokenizing" not in out and not list(tmp_path.rglob("*.ckpt"))  # before the data and the model
