"""``OnlineDPOModule``: the pair (the higher reward or the judge's pick is chosen; missing_eos_penalty), the training
loss equals ``dpo_loss`` on independent forwards over the completion tokens, gradients reach only the policy, beta
follows the epoch, exact resume, and the console script."""

from __future__ import annotations

import json
import shutil

import lightning as L
import pytest
import torch

from helpers import console_script
from lightalign.modules.losses.dpo import dpo_loss
from lightalign.modules.online_dpo import beta_for_epoch, chosen_rejected_rows, pair_from_rewards


def length_reward(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


def _module(tiny_dir, model=None, **kw):
    from lightalign import OnlineDPOModule

    kw.setdefault("max_completion_length", 6)
    kw.setdefault("learning_rate", 1e-3)
    if "judge" not in kw:
        kw.setdefault("reward_funcs", [length_reward])
    torch.manual_seed(0)
    return OnlineDPOModule(str(model or tiny_dir), from_config=True, **kw)


def _data(tiny_dir, data_dir, model=None, **kw):
    from lightalign import PromptDataModule

    kw.setdefault("batch_size", 4)
    return PromptDataModule(str(data_dir / "arithmetic_prompts.jsonl"), tokenizer=str(model or tiny_dir),
                            max_prompt_length=16, **kw)


def _rollout(texts, truncated):
    n = len(texts)
    return {"prompts": [f"p{i // 2}" for i in range(n)], "completions": list(texts), "texts": list(texts),
            "columns": {}, "truncated": torch.tensor(truncated), "completion_mask": torch.ones(n, 3, dtype=torch.long)}


def _stats(module):
    return module.train_stats


# ------------------------------------------------------------------------------------- the pair
def test_the_higher_reward_is_chosen():
    choice = pair_from_rewards(torch.tensor([0.1, 0.9, 0.5, 0.2, 0.3, 0.3, float("nan"), 0.0]))
    assert choice.tolist() == [1, 0, 0, 1]  # a tie goes to the first (TRL); NaN ranks below any number
    chosen, rejected = chosen_rejected_rows(choice)
    assert chosen.tolist() == [1, 2, 4, 7] and rejected.tolist() == [0, 3, 5, 6]


def test_the_module_chooses_by_reward_and_missing_eos_penalty_lowers_a_reward_without_eos(tiny_dir):
    module = _module(tiny_dir)
    rollout = _rollout(["a", "abc", "abcd", "ab", "abc", "abc"], [False, False, False, False, False, True])
    choice, rewards = module.rank(rollout, _stats(module))
    assert rewards.tolist() == [1, 3, 4, 2, 3, 3] and choice.tolist() == [1, 0, 0]
    penalised = _module(tiny_dir, missing_eos_penalty=2.5)
    choice, rewards = penalised.rank(rollout, _stats(penalised))
    assert rewards.tolist() == [1, 3, 4, 2, 3, 0.5] and choice.tolist() == [1, 0, 0]
    # the penalty decides a pair: without EOS the longer one loses
    choice, _ = penalised.rank(_rollout(["abcd", "ab"], [True, False]), _stats(penalised))
    assert choice.tolist() == [1]


def test_a_judges_choice_is_honoured(tiny_dir):
    calls = []

    def judge(prompts, pairs):
        calls.append((prompts, pairs))
        return [int("z" in b) for a, b in pairs]  # the second is better when it has a z

    module = _module(tiny_dir, judge=judge)
    choice, rewards = module.rank(_rollout(["a", "z", "z", "b", "c", "zz"], [False] * 6), _stats(module))
    assert rewards is None and choice.tolist() == [1, 0, 1]
    assert calls == [(["p0", "p1", "p2"], [["a", "z"], ["z", "b"], ["c", "zz"]])]
    with pytest.raises(ValueError, match="0 or 1"):
        _module(tiny_dir, judge=lambda p, c: [2] * len(p)).rank(_rollout(["a", "b"], [False, False]), module.train_stats)
    with pytest.raises(ValueError, match="exactly one"):
        _module(tiny_dir, judge=judge, reward_funcs=[length_reward])
    with pytest.raises(ValueError, match="'hinge' is not available online"):
        _module(tiny_dir, loss_type="hinge")


def test_missing_eos_penalty_is_one_knob_with_one_check_for_online_dpo_and_ppo(tiny_dir):
    """``missing_eos_penalty`` is ``MissingEOSKnobs``' in both methods: the same refusal of a negative penalty, and
    online DPO's refusal of it with a judge. Mutation: drop the group's check -> both build."""
    from lightalign import PPOModule

    for build in (_module, lambda d, **kw: PPOModule(str(d), from_config=True, reward_funcs=[length_reward], **kw)):
        with pytest.raises(ValueError, match=r"^missing_eos_penalty must be a positive number subtracted from a "
                                             r"reward, got -1\.0\.$"):
            build(tiny_dir, missing_eos_penalty=-1.0)
    with pytest.raises(ValueError, match="with a judge, which gives no reward to subtract it from"):
        _module(tiny_dir, judge=lambda p, c: [0] * len(p), reward_funcs=None, missing_eos_penalty=1.0)


# ------------------------------------------------------------------------------------- the loss
def _independent_sums(model, rollout):
    """Summed log-probs of each row's completion tokens, one unpadded forward per row."""
    sums = []
    for i in range(rollout["prompt_ids"].shape[0]):
        prompt = rollout["prompt_ids"][i][rollout["prompt_mask"][i].bool()]
        completion = rollout["completion_ids"][i][rollout["completion_mask"][i].bool()]
        ids = torch.cat([prompt, completion]).unsqueeze(0)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        sums.append(torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).sum())
    return torch.stack(sums)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_training_loss_equals_dpo_loss_on_independent_forwards(tiny_dir, data_dir, loss_type):
    module = _module(tiny_dir, loss_type=loss_type, beta=0.3, max_completion_length=10)
    module.configure_model()
    with torch.no_grad():  # the policy moves away from the reference, so the log-ratios are not all 0
        for p in module.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    _check_loss(module, tiny_dir, data_dir, loss_type, lambda rollout: _independent_sums(module.ref_model, rollout))
    assert all(p.grad is None and not p.requires_grad for p in module.ref_model.parameters())


def test_a_lora_policys_reference_is_its_base_with_the_adapters_off(tiny_dir, data_dir):
    pytest.importorskip("peft")
    module = _module(tiny_dir, beta=0.3, max_completion_length=10,
                     peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    module.configure_model()
    assert module.ref_model is None
    with torch.no_grad():  # LoRA's B starts at 0: move it so the adapters change the policy
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))

    def base_sums(rollout):
        with module.model.disable_adapter():
            return _independent_sums(module.model, rollout)

    _check_loss(module, tiny_dir, data_dir, "sigmoid", base_sums)
    assert all(p.grad is None for n, p in module.model.named_parameters() if "lora_" not in n)


def _check_loss(module, tiny_dir, data_dir, loss_type, reference_sums):
    data = _data(tiny_dir, data_dir)
    data.setup("fit")
    module.tokenizer = data.tokenizer
    batch = next(b for b in data.train_dataloader() if (b["prompt_attention_mask"] == 0).any())  # prompts padded
    torch.manual_seed(1)
    rollout = module.sample_pairs(batch)
    for row in (0, 3, 6):  # as if these had ended with EOS early (the random model rarely writes it): padding after
        rollout["completion_ids"][row, 4:] = data.tokenizer.pad_token_id
        rollout["completion_mask"][row, 4:] = 0
    mask = rollout["completion_mask"]
    assert (mask.sum(-1) < mask.shape[1]).any() and (rollout["prompt_mask"] == 0).any()  # padding on both sides
    loss = module.pair_loss(rollout, module.train_stats)
    chosen, rejected = module.last_pair["chosen"], module.last_pair["rejected"]
    rewards = module.last_pair["rewards"]
    assert (rewards[chosen] >= rewards[rejected]).all() and (rewards[chosen] > rewards[rejected]).any()
    with torch.no_grad():
        policy, ref = _independent_sums(module.model, rollout), reference_sums(rollout)
    lengths = mask.sum(-1).float()
    expected = dpo_loss(policy[chosen], policy[rejected], ref[chosen], ref[rejected], beta=0.3, loss_type=loss_type,
                        chosen_lengths=lengths[chosen], rejected_lengths=lengths[rejected])[0].mean()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    # the sigmoid loss is blind to tokens both completions of a pair share (the prompt): the logged sums are not
    logged = {k: module.train_stats[k].compute() for k in ("logps__chosen", "logps__rejected")}
    torch.testing.assert_close(logged["logps__chosen"], policy[chosen].mean(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(logged["logps__rejected"], policy[rejected].mean(), atol=1e-4, rtol=1e-5)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.model.parameters())


# ------------------------------------------------------------------------------------- beta schedule
class BetaPerEpoch(L.Callback):
    def __init__(self):
        self.betas = []

    def on_train_epoch_end(self, trainer, module):
        self.betas.append(float(trainer.callback_metrics["train/beta"]))


def test_beta_as_a_list_follows_the_epoch(tiny_dir, data_dir):
    assert [beta_for_epoch([0.5, 0.2], e) for e in range(3)] == [0.5, 0.2, 0.2] and beta_for_epoch(0.1, 7) == 0.1
    record = BetaPerEpoch()
    trainer = L.Trainer(accelerator="cpu", logger=False, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, max_epochs=3, limit_train_batches=1,
                        limit_val_batches=0, callbacks=[record])
    trainer.fit(_module(tiny_dir, beta=[0.5, 0.2], max_completion_length=3), _data(tiny_dir, data_dir))
    assert record.betas == pytest.approx([0.5, 0.2, 0.2])


# ------------------------------------------------------------------------------------- resume, console script
def test_killed_and_resumed_equals_uninterrupted(tiny_dir, data_dir, tmp_path):
    """Dropout on in the policy (so the RNG streams matter): a run resumed from its step-2 checkpoint ends
    bit-identical to the uninterrupted 4-step run."""
    model = tmp_path / "policy"
    model.mkdir()
    for f in tiny_dir.iterdir():
        shutil.copy(f, model / f.name)
    config = json.loads((model / "config.json").read_text())
    config["attention_dropout"] = 0.3
    (model / "config.json").write_text(json.dumps(config))

    def fit(ckpt_path=None, ckpt_dir=None):
        callbacks = [] if ckpt_dir is None else [L.pytorch.callbacks.ModelCheckpoint(
            dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)]
        module = _module(tiny_dir, model=model, disable_dropout=False, max_completion_length=4)
        L.seed_everything(3)
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, max_steps=4, limit_val_batches=0, callbacks=callbacks,
                            enable_checkpointing=ckpt_dir is not None)
        trainer.fit(module, _data(tiny_dir, data_dir, model=model), ckpt_path=ckpt_path)
        return module

    full = fit(ckpt_dir=tmp_path / "ckpt")
    resumed = fit(ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    a, b = full.state_dict(), resumed.state_dict()
    halfway = torch.load(tmp_path / "ckpt" / "epoch=0-step=2.ckpt", weights_only=False)["state_dict"]
    assert any((a[k] != halfway[k]).any() for k in a)  # steps 3 and 4 changed the weights
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=0, rtol=0, msg=name)


@pytest.mark.slow
def test_console_script_fits_the_shipped_config(repo, tmp_path):
    """On TRL GKD's conversation rows (``messages``, with the assistant's answer), so the one run also shows the
    fit-start note on the split rows and the exported model card (title, method's name, path, no vLLM knobs).
    Mutations: the note not printed -> fails; the card's title the folder's name -> fails."""
    chat = tmp_path / "chat.jsonl"  # 64 of the shipped conversations: 48 train + the config's 16 held out
    chat.write_text("".join((repo / "examples/data/chat_sft.jsonl").read_text().splitlines(keepends=True)[:64]))
    out = console_script.run(repo, "fit", "--config", "configs/online_dpo_quickstart.yaml", "--trainer.max_steps", "2",
                             "--plot.enabled", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
                             "--data.path", str(chat), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("Online DPO: 48 train and 16 validation rows are conversations ('messages'): the messages before each "
            "one's last assistant message are its prompt; that last message is dropped for online sampling: the "
            "policy samples its own completions (the reward functions still receive it, as their `completion` "
            "argument).") in (out.stdout + out.stderr).splitlines()
    export = next(tmp_path.rglob("hf_model"))
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()
    card = (export / "README.md").read_text()
    assert "\n# online_dpo_quickstart/version_0\n" in card and "lightalign's Online DPO (`OnlineDPOModule`)" in card
    assert f'folder = "{export.resolve()}"' in card and "vllm_" not in card


def test_conversational_prompts_reach_the_reward_function_as_messages(tiny_dir, tmp_path):
    from lightalign import PromptDataModule

    path = tmp_path / "chat_prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)})
                            + "\n" for i in range(8)))
    seen = []

    def reward(prompts, completions, answer, **columns):
        seen.append((prompts, completions, answer))
        return [float(len(c[0]["content"])) for c in completions]

    module = _module(tiny_dir, reward_funcs=[reward], max_completion_length=3)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, max_steps=1, limit_val_batches=0)
    trainer.fit(module, PromptDataModule(str(path), tokenizer=str(tiny_dir), batch_size=4))
    prompts, completions, answer = seen[0]
    assert len(prompts) == 8 and prompts[0] == prompts[1] and prompts[0][0]["role"] == "user"  # each prompt twice
    assert all(c[0]["role"] == "assistant" for c in completions) and answer[0] == answer[1]
    with pytest.raises(TypeError, match="max_completion_length"):
        _module(tiny_dir, max_new_tokens=8)


def test_a_judged_run_trains_and_validates(tiny_dir, data_dir):
    calls = []

    def judge(prompts, pairs):
        calls.append(len(pairs))
        return [1] * len(pairs)

    module = _module(tiny_dir, judge=judge, max_completion_length=3)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, max_steps=2, limit_val_batches=1,
                        val_check_interval=2)
    trainer.fit(module, _data(tiny_dir, data_dir, val_split_size=4, val_batch_size=4))
    metrics = trainer.callback_metrics
    assert calls == [4, 4, 4] and module.last_pair["chosen"].tolist() == [1, 3, 5, 7]  # 2 steps, then the win rate
    assert "train/loss" in metrics and "train/rewards/margins" in metrics and "val/contain_eos_token" in metrics
    assert "val/win_rate" in metrics and "train/win_rate" not in metrics
    assert "val/win_rate" in trainer.progress_bar_metrics  # with no reward, the progress bar shows the win rate
    assert "train/objective/scores" not in metrics  # no rewards with a judge


def test_the_win_rate_is_the_judges_share_of_prompts_the_policy_wins_against_the_reference(tiny_dir, data_dir):
    """The reference writes one known text (its head always picks token 100); a judge that sees exactly one such
    text per pair prefers the policy's completion on three of the four held prompts: val/win_rate is 0.75, whatever
    order each pair is shown in."""
    shown, favoured, sampled = [], set(), []

    def judge(prompts, pairs):
        answers = []
        for i, (prompt, (a, b)) in enumerate(zip(prompts, pairs)):
            assert (a == reference_text) != (b == reference_text), (a, b)  # one policy, one reference completion
            policy_at = 0 if b == reference_text else 1
            assert (a, b)[policy_at] == sampled[-1]["texts"][2 * i]  # the first of this prompt's sampled pair
            shown.append(policy_at)
            answers.append(policy_at if prompt in favoured else 1 - policy_at)
        return answers

    module = _module(tiny_dir, judge=judge, max_completion_length=4, generation_backend="generate")  # no probe
    module.configure_model()
    ref = module.ref_model
    head = torch.nn.Linear(ref.lm_head.in_features, ref.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-1e4)
        head.bias[100] = 1e4
    ref.lm_head = head
    sample_pairs = module.sample_pairs
    module.sample_pairs = lambda batch: sampled.append(sample_pairs(batch)) or sampled[-1]
    data = _data(tiny_dir, data_dir, val_split_size=4, val_batch_size=4)
    data.setup("fit")
    module.tokenizer = data.tokenizer
    reference_text = data.tokenizer.decode([100] * 4, skip_special_tokens=True)
    batch = next(iter(data.val_dataloader()))
    favoured.update(batch["prompts"][:3])
    module.validation_step(batch, 0)
    assert module.eval_stats["win_rate"].compute().item() == 0.75
    assert sorted(set(shown)) == [0, 1]  # the policy's completion was shown first and second
