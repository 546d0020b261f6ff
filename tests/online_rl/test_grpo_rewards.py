"""GRPOModule.score and the rollout: rewards -> (normalised, clipped) -> advantages, inside the module."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest
import torch
from torchmetrics.aggregation import MeanMetric


def advantages(module, rollout, stats):
    """The scoring stage, then GRPO's advantages from the rewards (as the rollout computes them)."""
    per_func, total = module.score(rollout, stats)
    return module.advantages_from_rewards(per_func, total, module.hparams.num_generations)


def column_reward(prompts, completions, value, **kwargs):
    """The reward is the row's ``value`` column: the test decides every reward."""
    return [float(v) for v in value]


def _rollout(values, truncated=None):
    n = len(values)
    return {"prompts": ["p"] * n, "completions": ["c"] * n, "texts": ["c"] * n,
            "columns": {"value": list(values)}, "completion_mask": torch.ones(n, 3, dtype=torch.long),
            "truncated": torch.zeros(n, dtype=torch.bool) if truncated is None else torch.tensor(truncated)}


class _Stats(dict):
    """Any metric name -> a MeanMetric (score() logs several)."""

    def __missing__(self, key):
        self[key] = MeanMetric()
        return self[key]


def test_score_under_ddp_scales_by_the_std_of_every_ranks_rewards(grpo_module):
    module = grpo_module(reward_funcs=[column_reward], scale_rewards="batch")
    mine, other_rank = [1.0, 0.0, 0.0, 1.0], [10.0, 20.0, 30.0, 40.0]
    module._trainer = SimpleNamespace(world_size=2, global_step=0)  # as on rank 0 of 2
    module.all_gather = lambda tensor: torch.stack([tensor, torch.tensor(other_rank)])
    adv = advantages(module, _rollout(mine), _Stats())
    std = statistics.stdev(mine + other_rank)
    assert adv.tolist() == pytest.approx([(r - 0.5) / (std + 1e-4) for r in mine], rel=1e-5)


# ---------------------------------------------------------------- the rollout inside the module
def _rollout_module(grpo_module, tokenizer, values, completions, truncated=None, **kw):
    """A GRPOModule on the tiny model whose ``generate`` returns one fixed group of 4 completions (token ids
    ``completions``, rewards ``values``), wired to a stand-in trainer: one micro-batch per optimizer step."""
    module = grpo_module(reward_funcs=[column_reward], num_generations=4, generation_batch_size=4,
                         log_entropy=False, **kw)
    module.configure_model()
    module.tokenizer = tokenizer
    module._trainer = SimpleNamespace(world_size=1, global_step=0, accumulate_grad_batches=1)
    prompt = torch.tensor(tokenizer("Q: 2+2=")["input_ids"])
    ids = torch.tensor(completions)
    rollout = _rollout(values, truncated)
    rollout.update(prompt_ids=prompt.repeat(4, 1), prompt_mask=torch.ones(4, prompt.numel(), dtype=torch.long),
                   completion_ids=ids, completion_mask=torch.ones_like(ids))
    module.generate = lambda batch, num_generations: {k: (v.clone() if torch.is_tensor(v) else v)
                                                      for k, v in rollout.items()}
    return module


def _loss_grads(module) -> list[torch.Tensor]:
    loss = module.training_step({"prompts": ["p"]}, 0)
    params = [p for p in module.model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params, allow_unused=True))


def test_a_step_raises_the_log_prob_of_the_rewarded_completions(grpo_module, tokenizer):
    """The loss gradient points away from the rewarded completions: a descent step makes completions with reward
    1 likelier relative to those with reward 0 (a sign error anywhere from rewards to loss turns this around)."""
    seven, three, eos = (tokenizer.convert_tokens_to_ids(t) for t in ("7", "3", tokenizer.eos_token))
    good, bad = [seven, seven, eos], [three, three, eos]
    module = _rollout_module(grpo_module, tokenizer, [1.0, 0.0, 1.0, 0.0], [good, bad, good, bad])
    loss_grads = _loss_grads(module)
    mb = module.rollout_buffer.chunks[0]
    logps, _ = module.token_logps(module.model, mb)
    rewarded = mb["completion_ids"][:, 0] == seven
    preference = (logps * mb["completion_mask"])[rewarded].sum() - (logps * mb["completion_mask"])[~rewarded].sum()
    params = [p for p in module.model.parameters() if p.requires_grad]
    pref_grads = torch.autograd.grad(preference, params, allow_unused=True)
    dot = sum((a * b).sum() for a, b in zip(loss_grads, pref_grads) if a is not None and b is not None)
    assert dot < 0  # -grad(loss) . grad(preference) > 0: gradient descent raises the preference


def test_mask_truncated_completions_takes_them_out_of_the_loss(grpo_module, tokenizer):
    """Two rollouts differ only in the tokens of their truncated completions (same rewards): with the mask the
    gradients are equal, without it they are not."""
    seven, three, eos = (tokenizer.convert_tokens_to_ids(t) for t in ("7", "3", tokenizer.eos_token))
    kept = [[seven, seven, eos], [three, three, eos]]
    truncated = [False, False, True, True]

    def grads(tail, mask):
        torch.manual_seed(0)  # the rollout's micro-batch order
        module = _rollout_module(grpo_module, tokenizer, [1.0, 0.0, 1.0, 0.0], kept + tail, truncated,
                                 mask_truncated_completions=mask)
        out = _loss_grads(module)
        if mask:
            mb = module.rollout_buffer.chunks[0]
            assert mb["completion_mask"][mb["completion_ids"][:, -1] != eos].sum() == 0
        return out

    a = grads([[seven, seven, seven], [three, three, three]], mask=True)
    b = grads([[three, seven, three], [seven, three, seven]], mask=True)
    for x, y in zip(a, b):
        if x is not None:
            torch.testing.assert_close(x, y, atol=1e-7, rtol=0)
    c = grads([[seven, seven, seven], [three, three, three]], mask=False)
    d = grads([[three, seven, three], [seven, three, seven]], mask=False)
    assert any(x is not None and not torch.allclose(x, y, atol=1e-7, rtol=0) for x, y in zip(c, d))


def test_score_normalizes_then_clips_the_rewards(grpo_module):
    values = [0.0, 1.0, 2.0, 5.0]  # mean 2, population variance 3.5
    std = statistics.pstdev(values)
    normalized = [(v - 2.0) / std for v in values]  # [-1.07, -0.53, 0, 1.60]

    module = grpo_module(reward_funcs=[column_reward], scale_rewards="none", normalize_rewards=True)
    got = advantages(module, _rollout(values), _Stats())
    assert got.tolist() == pytest.approx(normalized, abs=1e-5)  # centred already: the group mean is 0
    assert module.reward_normalizer.count == 4  # the running statistics saw the batch

    module = grpo_module(reward_funcs=[column_reward], scale_rewards="none", normalize_rewards=True, reward_clip=1.0)
    clipped = [max(-1.0, min(1.0, v)) for v in normalized]
    mean = sum(clipped) / 4
    assert advantages(module, _rollout(values), _Stats()).tolist() == pytest.approx([c - mean for c in clipped], abs=1e-5)

    module = grpo_module(reward_funcs=[column_reward], scale_rewards="none", reward_clip=2.0)
    assert advantages(module, _rollout(values), _Stats()).tolist() == pytest.approx([-1.25, -0.25, 0.75, 0.75])

    module = grpo_module(reward_funcs=[column_reward], scale_rewards="none", normalize_rewards=True)
    module.eval()  # validation scores do not move the running statistics
    assert advantages(module, _rollout(values), _Stats()).tolist() == pytest.approx([-2.0, -1.0, 0.0, 3.0])
    assert module.reward_normalizer.count == 0


def trl_scheduled_reward(prompts, completions, trainer_state, log_extra, log_metric, **kwargs):
    """Written for TRL 1.16's GRPOTrainer: a reward scheduled on ``trainer_state.global_step`` that logs a column of
    the completions table and a metric."""
    lengths = [len(c) for c in completions]
    log_extra("completion_chars", lengths)
    log_metric("chars_mean", sum(lengths) / len(lengths))
    seen.append((trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch))
    return [float(trainer_state.global_step) + length / 100 for length in lengths]


seen: list = []


def test_a_trl_reward_reading_trainer_state_and_logging_runs_unchanged(grpo_module, prompt_data, quiet_trainer,
                                                                      tmp_path):
    """TRL passes trainer_state, log_extra and log_metric to every reward function: one using all three trains
    unchanged; it sees each rollout's global step and the run's max_steps, its column is in the completions table
    (CompletionSamples' CSV) one value per completion, and its metric is logged as train/chars_mean, the mean of the
    logged values."""
    import csv

    from lightalign.callbacks.completions import CompletionSamples

    seen.clear()
    module = grpo_module(reward_funcs=[trl_scheduled_reward], learning_rate=0.0)
    trainer = quiet_trainer(max_steps=2, callbacks=[CompletionSamples(every_n_steps=1, max_rows=64)],
                            default_root_dir=str(tmp_path))
    trainer.fit(module, prompt_data())

    assert [s for s, _, _ in seen] == [0, 1] and {(m, e) for _, m, e in seen} == {(2, 0.0)}
    samples = module.last_samples  # the last rollout's table: the column beside the rewards, per completion
    assert [row["completion_chars"] for row in samples] == [len(row["completion"]) for row in samples]
    assert float(trainer.callback_metrics["train/chars_mean"]) == pytest.approx(
        statistics.mean(row["completion_chars"] for row in samples))
    with open(tmp_path / "completions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(int(r["completion_chars"]) == len(r["completion"]) for r in rows)
