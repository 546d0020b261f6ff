"""GRPOModule and PromptDataModule: rollouts, reuse counts, accumulation, rewards through training, errors."""

from __future__ import annotations

import csv

import lightning as L
import pytest
import torch

from lightalign import CompletionSamples, PromptDataModule


def test_prompt_collator_left_pads_and_keeps_columns(tiny_dir, data_dir, prompt_data):
    dm = prompt_data()
    dm.setup("fit")
    rows = [dm.train_dataset[i] for i in range(3)]
    batch = dm.collate_fn()(rows)
    ids, mask = batch["prompt_input_ids"], batch["prompt_attention_mask"]
    for i, row in enumerate(rows):
        n = len(row["prompt_input_ids"])
        assert ids[i, -n:].tolist() == row["prompt_input_ids"] and mask[i, -n:].all() and not mask[i, :-n].any()
    assert batch["prompts"] == [r["prompt"] for r in rows]
    assert batch["columns"]["answer"] == [r["answer"] for r in rows]


def test_generation_count_follows_steps_per_generation_and_num_iterations(tiny_dir, data_dir, quiet_trainer, grpo_module, prompt_data):
    calls = []
    module = grpo_module(generation_batch_size=8, steps_per_generation=2, num_iterations=3)
    real = module.generate

    def counting(batch, n):
        calls.append(len(batch["prompts"]))
        return real(batch, n)

    module.generate = counting
    # 12 micro-batches = 6 optimizer steps with accumulation 2; a rollout serves 2 x 3 micro-batches -> 2 rollouts
    trainer = quiet_trainer(max_steps=6, accumulate_grad_batches=2)
    trainer.fit(module, prompt_data())
    assert module.generation_count == 2 and calls == [2, 2]  # 8 completions = 2 prompts x 4
    assert trainer.global_step == 6


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_accumulation_4x2_equals_1x8(loss_type, quiet_trainer, grpo_module, prompt_data, grad_capture):
    def one_step_grads(accumulate):
        L.seed_everything(0)
        module = grpo_module(generation_batch_size=8, loss_type=loss_type,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
        capture = grad_capture()
        quiet_trainer(max_steps=1, accumulate_grad_batches=accumulate, callbacks=[capture]).fit(module, prompt_data())
        return capture.grads[0]

    full = one_step_grads(1)
    accum = one_step_grads(4)
    assert full.keys() == accum.keys() and full
    nonzero = 0
    for name in full:
        torch.testing.assert_close(accum[name], full[name], atol=1e-6, rtol=1e-5, msg=name)
        nonzero += int(full[name].abs().sum() > 0)
    assert nonzero > 0


def test_completion_mask_ends_at_first_eos(tiny_dir, data_dir, grpo_module, prompt_data):
    module = grpo_module(generation_backend="generate")  # (it stands in for model.generate)
    module.configure_model()
    dm = prompt_data()
    dm.setup("fit")
    module.tokenizer = dm.tokenizer
    batch = dm.collate_fn()([dm.train_dataset[0]])
    p = batch["prompt_input_ids"]
    eos = dm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    digit = dm.tokenizer.convert_tokens_to_ids("7")
    fake = torch.tensor([[digit, eos, digit, digit], [digit, digit, digit, digit]])

    def fake_generate(input_ids, **kw):  # the shared prefill hands over the prompts already repeated
        assert input_ids.shape[0] == 2 and kw["use_cache"] and not module.model.training
        return torch.cat([p.repeat(2, 1), fake], dim=1)

    module.model.generate = fake_generate
    module.model.train()
    out = module.generate(batch, 2)
    assert module.model.training  # back to train mode
    assert out["completion_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert out["truncated"].tolist() == [False, True]
    assert out["texts"] == ["7", "7777"]
    assert out["columns"]["answer"] == [batch["columns"]["answer"][0]] * 2


def test_trl_style_reward_gets_extra_columns_and_training_logs(tiny_dir, data_dir, tmp_path, grpo_module, prompt_data):
    seen = []

    def exact_answer(prompts, completions, answer, **kwargs):  # written for TRL, runs unchanged
        seen.append((len(prompts), len(completions), len(answer), "completion_ids" in kwargs))
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    module = grpo_module(reward_funcs=[exact_answer, "lightalign.rewards.digit_fraction_reward"],
                     reward_weights=[1.0, 0.5], generation_batch_size=8, beta=0.05)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, logger=L.pytorch.loggers.CSVLogger(tmp_path),
                        callbacks=[CompletionSamples(every_n_steps=1, max_rows=3)])
    trainer.fit(module, prompt_data())
    assert seen and all(s == (8, 8, 8, True) for s in seen)
    assert module.ref_model is not None  # beta > 0 builds the reference
    logged = trainer.callback_metrics
    for key in ("train/reward/mean", "train/reward/std", "train/reward/exact_answer", "train/reward/digit_fraction_reward",
                "train/completions/mean_length", "train/completions/clipped_ratio", "train/clip_ratio", "train/kl",
                "train/entropy", "train/loss"):
        assert key in logged, key
    with open(tmp_path / "lightning_logs" / "version_0" / "completions.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and set(rows[0]) >= {"step", "prompt", "completion", "reward", "exact_answer"}


def test_no_reference_without_kl(tiny_dir, data_dir, quiet_trainer, grpo_module, prompt_data):
    module = grpo_module(generation_batch_size=8)
    quiet_trainer(max_steps=1).fit(module, prompt_data())
    assert module.ref_model is None


def test_num_iterations_reuse_uses_old_logps(tiny_dir, data_dir, quiet_trainer, grpo_module, prompt_data):
    module = grpo_module(generation_batch_size=8, num_iterations=2, learning_rate=5e-2)
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(module, prompt_data())
    assert module.generation_count == 1
    assert "old_logps" in module.rollout_buffer.chunks[0]


def test_conversational_prompts_get_generation_prompt(tiny_dir, write_jsonl, tokenizer):
    dm = PromptDataModule(write_jsonl([{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}]), tokenizer=str(tiny_dir))
    dm.setup("fit")
    assert tokenizer.decode(dm.train_dataset[0]["prompt_input_ids"]).endswith("<|im_start|>assistant\n")


def test_a_resumed_run_continues_the_completions_table_without_repeating_steps(tmp_path, grpo_module, prompt_data):
    """Interrupted after step 3 with its last checkpoint at step 2, resumed to step 4: the table holds each step once
    (the interrupted run's step-3 rows are dropped; the resumed run samples and writes step 3 again)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(max_steps, ckpt_path=None):
        L.seed_everything(0)
        trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, enable_progress_bar=False,
                            enable_model_summary=False, logger=L.pytorch.loggers.CSVLogger(tmp_path, version=0),
                            callbacks=[CompletionSamples(every_n_steps=1, max_rows=2),
                                       ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2,
                                                       save_top_k=-1)])
        trainer.fit(grpo_module(generation_batch_size=8), prompt_data(), ckpt_path=ckpt_path)

    fit(3)  # checkpoints at step 2; the table has steps 1, 2, 3
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=2.ckpt")
    fit(4, str(checkpoint))
    with open(tmp_path / "lightning_logs" / "version_0" / "completions.csv") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == [1, 1, 2, 2, 3, 3, 4, 4]
