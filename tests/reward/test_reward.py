"""RewardModule and reward_loss: the loss against hand computations, the margin column, one forward per batch,
a causal LM checkpoint gaining a score head, LoRA, accumulation, bad input, and the export used as GRPO's reward."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightalign import PreferenceDataModule, RewardModule, reward_loss
from lightalign.datamodules.formats import DataFormatError


def _trainer(**kw):
    kw.setdefault("max_steps", 2)
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **kw)


def _rows(data_dir, n):
    lines = (data_dir / "arithmetic_preference.jsonl").read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]


def _neg_logsigmoid(x: float) -> float:
    return math.log(1.0 + math.exp(-x))


# ------------------------------------------------------------------------------------------ loss
def test_reward_loss_against_hand_computation():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    # plain Bradley-Terry: differences 1 and -1
    expected = (_neg_logsigmoid(1.0) + _neg_logsigmoid(-1.0)) / 2  # 0.8132616875
    assert reward_loss(chosen, rejected).item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.8132616875, abs=1e-9)
    # per-pair margins: differences 2-1-0.5 = 0.5 and 0-1-0 = -1; centering: 0.1 * mean(3^2, 1^2) = 0.5
    margin = torch.tensor([0.5, 0.0])
    expected = (_neg_logsigmoid(0.5) + _neg_logsigmoid(-1.0)) / 2 + 0.1 * (9.0 + 1.0) / 2
    got = reward_loss(chosen, rejected, margin=margin, center_rewards_coefficient=0.1)
    assert got.item() == pytest.approx(expected, abs=1e-6) and expected == pytest.approx(1.3936694, abs=1e-6)
    # computed in float32 from bfloat16 rewards
    assert reward_loss(chosen.bfloat16(), rejected.bfloat16()).dtype == torch.float32


def test_reward_loss_gradient_follows_the_formula():
    chosen = torch.tensor([0.3, -0.2], requires_grad=True)
    rejected = torch.tensor([0.1, 0.4], requires_grad=True)
    reward_loss(chosen, rejected, center_rewards_coefficient=0.5).backward()
    d = (chosen - rejected).detach()
    s = (chosen + rejected).detach()
    # d/dr_c of mean(-logsigmoid(d)) = -sigmoid(-d)/B; of 0.5*mean(s^2) = 0.5*2*s/B
    torch.testing.assert_close(chosen.grad, -torch.sigmoid(-d) / 2 + 0.5 * s)
    torch.testing.assert_close(rejected.grad, torch.sigmoid(-d) / 2 + 0.5 * s)


# ------------------------------------------------------------------------------------------ data
def test_margin_column_reaches_the_batch_and_a_bad_margin_names_its_row(tiny_dir, write_jsonl, tmp_path):
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 0.5},
            {"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": 2}]
    dm = PreferenceDataModule(write_jsonl(rows), tokenizer=str(tiny_dir), prompt_sharing=False, shuffle=False)
    dm.setup("fit")
    batch = dm.collate_fn()([dm.train_dataset[0], dm.train_dataset[1]])
    torch.testing.assert_close(batch["margin"], torch.tensor([0.5, 2.0]))
    assert batch["input_ids"].shape[0] == 4
    # CSV cells are text: numeric strings are numbers
    csv = tmp_path / "pairs.csv"
    csv.write_text("prompt,chosen,rejected,margin\n1+1=,2,3,1.5\n2+2=,4,5,-1\n")
    dm = PreferenceDataModule(str(csv), tokenizer=str(tiny_dir), prompt_sharing=False, shuffle=False)
    dm.setup("fit")
    assert [dm.train_dataset[i]["margin"] for i in range(2)] == [1.5, -1.0]
    # a string among numbers is caught as the file is read, by its line; a missing or non-finite number by its row
    for bad, message in [("large", r"line 3 \(lines counted from 1\): column 'margin' holds a string \"large\""),
                         (None, r"row 2, column 'margin'.*not a finite number"),
                         (float("nan"), r"row 2, column 'margin'.*not a finite number")]:
        rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "0", "margin": 1.0} for i in range(3)]
        rows[2]["margin"] = bad
        dm = PreferenceDataModule(write_jsonl(rows, f"bad{bad}.jsonl"), tokenizer=str(tiny_dir))
        with pytest.raises(DataFormatError, match=message):
            dm.setup("fit")


# ------------------------------------------------------------------------------------------ module
@pytest.fixture
def pairs(tiny_dir, data_dir):
    from datasets import Dataset

    def make(n=16, **kw):
        kw.setdefault("batch_size", 4)
        return PreferenceDataModule(Dataset.from_list(_rows(data_dir, n)), tokenizer=str(tiny_dir), max_length=64,
                                    **kw)

    return make


def test_one_forward_scores_each_sequence_as_alone(tiny_dir, pairs):
    """Chosen and rejected of a padded batch in one forward give each sequence's own (unpadded) score."""
    torch.manual_seed(0)
    module = RewardModule(str(tiny_dir), from_config=True)
    dm = pairs(prompt_sharing=False, shuffle=False)
    dm.setup("fit")
    module.configure_model()
    # a checkpoint whose config names another pad id: the data tokenizer's (what the batches are padded with) wins
    module.model.config.pad_token_id = 7
    module._trainer = SimpleNamespace(datamodule=dm)
    module.set_pad_token_id()
    assert module.model.config.pad_token_id == dm.tokenizer.pad_token_id == 0
    module.model.eval()
    batch = dm.collate_fn()([dm.train_dataset[i] for i in range(4)])
    calls = []
    hook = module.model.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        chosen, rejected = module.pair_rewards(batch)
    hook.remove()
    assert len(calls) == 1 and chosen.shape == rejected.shape == (4,)
    assert batch["attention_mask"].sum(-1).min() < batch["input_ids"].shape[1]  # some rows are padded
    for i, row in enumerate(batch["input_ids"]):
        n = int(batch["attention_mask"][i].sum())
        with torch.no_grad():
            alone = module.model(input_ids=row[None, :n]).logits[0, 0]
        torch.testing.assert_close(torch.cat([chosen, rejected])[i], alone, atol=1e-5, rtol=1e-5)


def test_fit_logs_every_metric_and_switches_to_padded_rows(tiny_dir, pairs):
    from torchmetrics.classification import BinaryAccuracy

    L.seed_everything(0)
    module = RewardModule(str(tiny_dir), from_config=True, learning_rate=1e-3, center_rewards_coefficient=0.01,
                          eval_metrics={"pair_acc": BinaryAccuracy()})
    dm = pairs(val_split_size=4)  # prompt_sharing left at its default (on)
    trainer = _trainer(max_steps=2, limit_val_batches=1, val_check_interval=2)
    trainer.fit(module, dm)
    assert dm.prompt_sharing is False
    logged = trainer.callback_metrics
    for stage in ("train", "val"):
        for key in ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected"):
            assert torch.isfinite(logged[f"{stage}/{key}"]), f"{stage}/{key}"
    # the margin is the difference of the mean rewards; sigmoid(margin) > 0.5 <=> accuracy
    torch.testing.assert_close(logged["val/margin"], logged["val/rewards/chosen"] - logged["val/rewards/rejected"])
    assert logged["val/pair_acc"].item() == pytest.approx(logged["val/accuracy"].item(), abs=1e-6)


def test_causal_lm_checkpoint_gets_a_new_score_head(tiny_dir, tmp_path, tiny_model, tokenizer, caplog):
    tiny_model.save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    module = RewardModule(str(tmp_path / "lm"))
    with caplog.at_level("INFO"):
        module.configure_model()
    assert type(module.model).__name__ == "Qwen2ForSequenceClassification" and module.model.config.num_labels == 1
    assert "score head (score.weight) is new" in caplog.text
    # the backbone is the checkpoint's
    torch.testing.assert_close(module.model.model.embed_tokens.weight, tiny_model.model.embed_tokens.weight)
    torch.testing.assert_close(module.model.model.layers[-1].mlp.down_proj.weight,
                               tiny_model.model.layers[-1].mlp.down_proj.weight)


def test_accumulation_equals_one_big_batch(tiny_dir, data_dir, grad_capture, write_jsonl):
    rows = [dict(r, margin=0.25 * (i % 3)) for i, r in enumerate(_rows(data_dir, 8))]
    path = write_jsonl(rows)

    def one_step_grads(batch_size, accumulate):
        L.seed_everything(0)
        module = RewardModule(str(tiny_dir), from_config=True, center_rewards_coefficient=0.1,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
        dm = PreferenceDataModule(path, tokenizer=str(tiny_dir), batch_size=batch_size)
        capture = grad_capture()
        _trainer(max_steps=1, accumulate_grad_batches=accumulate, callbacks=[capture]).fit(module, dm)
        return capture.grads[0]

    full, accum = one_step_grads(4, 1), one_step_grads(2, 2)
    assert full.keys() == accum.keys() and "model.score.weight" in full
    for name in full:
        torch.testing.assert_close(accum[name], full[name], atol=1e-6, rtol=1e-4, msg=name)


def test_lora_trains_the_score_head_and_exports_a_merged_classifier(tiny_dir, pairs, grad_capture, tmp_path):
    pytest.importorskip("peft")
    from lightalign.rewards.model import RewardModel

    L.seed_everything(0)
    module = RewardModule(str(tiny_dir), from_config=True, learning_rate=1e-2,
                          peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    capture = grad_capture()
    dm = pairs()
    _trainer(max_steps=2, callbacks=[capture]).fit(module, dm)
    head = [n for n in capture.grads[0] if "score" in n]
    assert head and all(capture.grads[0][n].abs().sum() > 0 for n in head), head
    assert any("lora_" in n for n in capture.grads[0])
    trained_head = module.model.get_base_model().score.modules_to_save["default"].weight.detach().clone()
    out = module.export_hf(tmp_path / "rm", tokenizer=dm.tokenizer)
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").exists()
    config = json.loads((out / "config.json").read_text())  # transformers 5 writes num_labels as id2label
    assert len(config["id2label"]) == 1 and config["architectures"] == ["Qwen2ForSequenceClassification"]
    scorer = RewardModel(str(out), device="cpu").load()
    torch.testing.assert_close(scorer.model.score.weight, trained_head)


def test_bad_knobs_are_refused_at_construction(tiny_dir, tiny_model):
    with pytest.raises(ValueError, match="center_rewards_coefficient must be >= 0"):
        RewardModule(str(tiny_dir), from_config=True, center_rewards_coefficient=-0.01)
    with pytest.raises(ValueError, match="num_labels=1"):
        RewardModule(model=tiny_model)
    with pytest.raises(ValueError, match="task_type SEQ_CLS"):
        RewardModule(str(tiny_dir), from_config=True, peft_config={"r": 4, "task_type": "CAUSAL_LM"})


def test_reward_model_folder_without_a_score_head_is_refused(tmp_path, tiny_model, tokenizer):
    from lightalign.rewards.model import RewardModel

    tiny_model.save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match=r"has no score head .*score\.weight.*RewardModule"):
        RewardModel(str(tmp_path / "lm"), device="cpu").load()
    with pytest.raises(ValueError, match=r"has no score head \(its config.json names \['Qwen2ForCausalLM'\]\)"):
        RewardModel(str(tmp_path / "lm")).check()  # what resolve_reward_funcs runs: config.json only


# ------------------------------------------------------------------------------------------ end to end
def test_trained_reward_model_scores_in_reward_model_and_drives_grpo(tiny_dir, data_dir, tmp_path, quiet_trainer,
                                                                    prompt_data):
    """Train a reward model on the shipped pairs, export it; RewardModel(folder) gives the module's own scores,
    and GRPO trains with the folder as its reward function."""
    from lightalign import GRPOModule, HFExport
    from lightalign.rewards.model import RewardModel

    L.seed_everything(0)
    module = RewardModule(str(tiny_dir), from_config=True, learning_rate=1e-3)
    dm = PreferenceDataModule(str(data_dir / "arithmetic_preference.jsonl"), tokenizer=str(tiny_dir), batch_size=8,
                              max_length=64)
    folder = tmp_path / "reward_model"
    _trainer(max_steps=3, callbacks=[HFExport(output_dir=str(folder))]).fit(module, dm)
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()

    prompts, completions = ["21+82=", "97+38=", "51-28="], ["103", "135", "23 and more"]
    scorer = RewardModel(str(folder), device="cpu", batch_size=2)
    scores = scorer(prompts, completions)
    module.model.eval()
    tok = dm.tokenizer
    with torch.no_grad():
        own = [module.model(input_ids=torch.tensor([tok(p + c, add_special_tokens=False)["input_ids"]])).logits[0, 0]
               for p, c in zip(prompts, completions)]
    assert scores == pytest.approx([float(x) for x in own], abs=1e-5)

    grpo = GRPOModule(str(tiny_dir), from_config=True, reward_funcs=[str(folder)], num_generations=4,
                      max_completion_length=4, learning_rate=1e-3)
    trainer = quiet_trainer(max_steps=1, log_every_n_steps=1)
    trainer.fit(grpo, prompt_data(batch_size=2))
    assert torch.isfinite(trainer.callback_metrics["train/reward/reward_model"]), sorted(trainer.callback_metrics)
    assert trainer.global_step == 1


def test_reward_model_learns_a_learnable_preference(tiny_dir, data_dir):
    """Pairs whose chosen completion is a correct-looking answer and whose rejected one ends in a '?': after a few
    steps held-out pairs are ranked right, with a positive margin (a flipped loss would rank them wrong)."""
    from datasets import Dataset

    rows = [{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"] + "?"}
            for r in _rows(data_dir, 96)]
    L.seed_everything(0)
    module = RewardModule(str(tiny_dir), from_config=True, learning_rate=3e-3)
    dm = PreferenceDataModule(Dataset.from_list(rows[:64]), tokenizer=str(tiny_dir), batch_size=8,
                              val_path=Dataset.from_list(rows[64:]), prompt_sharing=False)
    trainer = _trainer(max_steps=15)
    before = trainer.validate(module, datamodule=dm, verbose=False)[0]
    trainer.fit(module, dm)
    after = trainer.validate(module, datamodule=dm, verbose=False)[0]
    assert after["val/accuracy"] == 1.0 and after["val/margin"] > 1.0 > before["val/margin"]
    assert after["val/loss"] < before["val/loss"] - 0.3
