"""GRPOModule's TRL-parity knobs inside the module: the entropy bonus and its adaptive controller (state in the
checkpoint), the high-entropy token mask, multi_objective_aggregation, normalize_rewards under DDP,
num_generations_eval, generation_kwargs / cache_implementation and the prompt data's chat_template_kwargs."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest
import torch
from torchmetrics.aggregation import MeanMetric

import lightalign.modules.grpo as grpo_mod
from lightalign.modules.losses.entropy import EntropyController, high_entropy_mask
from lightalign.modules.losses.advantages import normalize_then_sum


def advantages(module, rollout, stats):
    """The scoring stage, then GRPO's advantages from the rewards (as the rollout computes them)."""
    per_func, total = module.score(rollout, stats)
    return module.advantages_from_rewards(per_func, total, module.hparams.num_generations)


def column_reward(prompts, completions, value, **kwargs):
    return [float(v) for v in value]


def other_reward(prompts, completions, other, **kwargs):
    return [float(v) for v in other]


class _Stats(dict):
    def __missing__(self, key):
        self[key] = MeanMetric()
        return self[key]


def _rollout(values, other=None):
    n = len(values)
    columns = {"value": list(values)} | ({} if other is None else {"other": list(other)})
    return {"prompts": ["p"] * n, "completions": ["c"] * n, "texts": ["c"] * n, "columns": columns,
            "completion_mask": torch.ones(n, 3, dtype=torch.long), "truncated": torch.zeros(n, dtype=torch.bool)}


def _module(grpo_module, tokenizer, **kw):
    """The tiny model (same random weights each time) with a fixed group of 4 completions (rewards 1, 0, 1, 0),
    one micro-batch per step."""
    torch.manual_seed(0)
    module = grpo_module(reward_funcs=[column_reward], num_generations=4, generation_batch_size=4, log_entropy=False,
                         **kw)
    module.configure_model()
    module.tokenizer = tokenizer
    module._trainer = SimpleNamespace(world_size=1, global_step=0, accumulate_grad_batches=1)
    seven, three, eos = (tokenizer.convert_tokens_to_ids(t) for t in ("7", "3", tokenizer.eos_token))
    prompt = torch.tensor(tokenizer("Q: 2+2=")["input_ids"])
    ids = torch.tensor([[seven, three, seven, eos], [three, eos, 0, 0], [seven, seven, eos, 0], [three, seven, three, seven]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    rollout = _rollout([1.0, 0.0, 1.0, 0.0])
    rollout.update(prompt_ids=prompt.repeat(4, 1), prompt_mask=torch.ones(4, prompt.numel(), dtype=torch.long),
                   completion_ids=ids, completion_mask=mask, truncated=torch.tensor([False, False, False, True]))
    module.generate = lambda batch, num_generations: {k: (v.clone() if torch.is_tensor(v) else v)
                                                      for k, v in rollout.items()}
    return module


def _params(module):
    return [p for p in module.model.parameters() if p.requires_grad]


def _grads(module):
    torch.manual_seed(0)
    loss = module.training_step({"prompts": ["p"]}, 0)
    return list(torch.autograd.grad(loss, _params(module), allow_unused=True))


# ---------------------------------------------------------------- entropy bonus and controller
def test_entropy_coef_adds_minus_coef_times_the_mean_entropy_gradient(grpo_module, tokenizer):
    coef = 0.5
    base = _grads(_module(grpo_module, tokenizer))
    module = _module(grpo_module, tokenizer, entropy_coef=coef)
    with_bonus = _grads(module)
    mb = module.rollout_buffer.chunks[0]
    _, ent = module.token_logps(module.model, mb, with_entropy=True, entropy_grad=True)
    mean_entropy = ent.sum() / mb["completion_mask"].sum()  # dapo: the step's completion tokens
    entropy_grads = torch.autograd.grad(mean_entropy, _params(module), allow_unused=True)
    changed = False
    for b, w, h in zip(base, with_bonus, entropy_grads):
        if h is None:
            continue
        torch.testing.assert_close(w, b - coef * h, atol=1e-6, rtol=1e-5)
        changed |= bool((h.abs() > 1e-6).any())
    assert changed


def test_adaptive_entropy_applies_no_bonus_before_its_first_measurement(grpo_module, tokenizer):
    base = _grads(_module(grpo_module, tokenizer))
    module = _module(grpo_module, tokenizer, entropy_coef=0.5, use_adaptive_entropy=True, entropy_target=100.0)
    first = _grads(module)
    for b, f in zip(base, first):
        if b is not None:
            torch.testing.assert_close(f, b)
    control = module.entropy_control
    assert control.window_count == module.rollout_buffer.chunks[0]["completion_mask"].sum().item()  # the step's tokens observed
    control.step()  # entropy (a few nats) <= target 100 -> coefficient up, and applied from now on
    assert control.coef == pytest.approx(0.505) and control.applied_coef() == pytest.approx(0.505)
    module.rollout_buffer.pos = 0
    assert any(not torch.allclose(b, g) for b, g in zip(base, _grads(module)) if b is not None)


def test_entropy_controller_rule():
    c = EntropyController(0.1, adaptive=True, target=1.0, delta=0.05, low=0.0, high=0.12)
    assert c.applied_coef() == 0.0  # no measurement yet
    c.observe(torch.tensor(1.5), torch.tensor(3.0))  # two micro-batches: mean (1.5 + 4.5) / (3 + 3) = 1.0
    c.observe(torch.tensor(4.5), torch.tensor(3.0))
    c.step()
    assert c.last_entropy == 1.0 and c.coef == pytest.approx(0.12)  # <= target: up, capped at high
    assert c.applied_coef() == pytest.approx(0.12)
    c.observe(torch.tensor(6.0), torch.tensor(3.0))
    c.step(reduce_sum=lambda t: t * 2)  # as if two ranks measured the same: mean 2.0 > target: down
    assert c.last_entropy == 2.0 and c.coef == pytest.approx(0.07) and c.applied_coef() == 0.0
    assert c.window_sum == 0.0 and c.window_count == 0.0
    fixed = EntropyController(0.3)
    fixed.observe(torch.tensor(1.0), torch.tensor(1.0))
    fixed.step()
    assert fixed.coef == 0.3 and fixed.applied_coef() == 0.3


def test_entropy_controller_state_is_in_the_checkpoint(grpo_module):
    module = grpo_module(entropy_coef=0.1, use_adaptive_entropy=True)
    module.entropy_control.observe(torch.tensor(0.1), torch.tensor(1.0))
    module.entropy_control.step()
    checkpoint = {}
    module.on_save_checkpoint(checkpoint)
    fresh = grpo_module(entropy_coef=0.1, use_adaptive_entropy=True)
    fresh.on_load_checkpoint(checkpoint)
    assert fresh.entropy_control.state_dict() == module.entropy_control.state_dict()
    assert fresh.entropy_control.coef == pytest.approx(0.105) and fresh.entropy_control.last_entropy == pytest.approx(0.1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(use_adaptive_entropy=True, entropy_coef=2.0), "must lie in"),
    (dict(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1), "entropy_coef_min"),
    (dict(use_adaptive_entropy=True, entropy_coef_delta=0.0), "entropy_coef_delta"),
    (dict(top_entropy_quantile=-0.1), "top_entropy_quantile"),
    (dict(loss_type="cispo"), "epsilon_high"),
    (dict(num_generations_eval=0), "num_generations_eval"),
    (dict(multi_objective_aggregation="mean"), "multi_objective_aggregation"),
    (dict(multi_objective_aggregation="normalize_then_sum", normalize_rewards=True), "unset normalize_rewards"),
    (dict(generation_kwargs={"max_new_tokens": 5}), "use max_completion_length"),
    (dict(generation_kwargs={"temperature": 0.5}), "use temperature"),
    (dict(generation_kwargs={"not_a_field": 1}), "not a transformers GenerationConfig field"),
    (dict(cache_implementation="static"), "share_prefill: false"),
    (dict(cache_implementation="nope", share_prefill=False), "unknown"),
])
def test_module_knob_errors_at_construction(grpo_module, kwargs, message):
    with pytest.raises(ValueError, match=message):
        grpo_module(**kwargs)


@pytest.mark.parametrize("knobs", [
    dict(loss_type="grpo", importance_sampling_level="sequence", delta=3.0, off_policy_mask_threshold=0.4,
         beta=0.05, use_bias_correction_kl=True),
    dict(loss_type="sapo", sapo_temperature_pos=0.7, sapo_temperature_neg=1.3),
    dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5),
    dict(loss_type="cispo", epsilon_high=4.0, entropy_coef=0.2),
])
def test_loss_knobs_reach_grpo_loss(grpo_module, tokenizer, kwargs_spy, knobs):
    """Every loss knob of the module is what training_step hands to grpo_loss (a dropped one would be silent)."""
    seen = kwargs_spy(grpo_mod, "grpo_loss")
    module = _module(grpo_module, tokenizer, **knobs)
    torch.manual_seed(0)
    module.training_step({"prompts": ["p"]}, 0)
    config = seen["config"]  # the loss knobs travel as the module's GRPOLossConfig
    for name, value in knobs.items():
        got = getattr(config, name) if name in config.knob_names() else seen[name]
        assert got == value, name
    assert ("entropies" in seen and seen["entropies"] is not None) == ("entropy_coef" in knobs)
    assert "loss_scale" in seen  # the module's rescale of dapo-like losses, taken out of the entropy bonus


# ---------------------------------------------------------------- high-entropy token mask
def test_high_entropy_mask_keeps_the_top_quantile():
    ent = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # real values sorted 0.1 0.3 0.5 0.7 0.9; quantile 0.6 at position 2.4 -> 0.5 + 0.4 * 0.2 = 0.58
    assert high_entropy_mask(ent, mask, 0.4).tolist() == [[False, False, True], [False, True, False]]
    assert high_entropy_mask(ent, mask, 1.0).tolist() == mask.bool().tolist()
    assert high_entropy_mask(ent, mask, 0.0).tolist() == [[False, False, True], [False, False, False]]
    # a pool with another rank's tokens (and the padding sentinel): sorted 0.1 0.3 0.5 0.7 0.9 2 3 4 -> the 0.6
    # quantile at position 4.2 is 0.9 + 0.2 * 1.1 = 1.12: none of this rank's tokens is kept
    pool = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.7, 2.0, 3.0, 4.0, -1e9])
    assert not high_entropy_mask(ent, mask, 0.4, pool=pool).any()


def test_high_entropy_quantile_under_ddp_is_over_every_ranks_tokens(grpo_module):
    module = grpo_module(top_entropy_quantile=0.4)
    module._trainer = SimpleNamespace(world_size=2)
    other = torch.tensor([2.0, 3.0, 4.0])  # the other rank's 3 real tokens (this rank has 5)

    def all_gather(x):
        if x.dim() == 0:
            return torch.stack([x, torch.tensor(other.numel())])
        return torch.stack([x, torch.cat([other, torch.full((x.numel() - other.numel(),), -1e9)])])

    module.all_gather = all_gather
    ent = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
    # pooled 0.1 0.3 0.5 0.7 0.9 2 3 4: the 0.6 quantile is 1.12, above every token of this rank
    assert not module._high_entropy_mask(ent, mask).any()
    module._trainer = SimpleNamespace(world_size=1)
    assert module._high_entropy_mask(ent, mask).tolist() == [[False, False, True], [False, True, False]]


def test_top_entropy_quantile_zeroes_the_policy_gradient_of_low_entropy_tokens(grpo_module, tokenizer, monkeypatch):
    seen = {}
    real = grpo_mod.grpo_loss

    def spy(per_token_logps, *args, **kw):
        per_token_logps.retain_grad()
        seen.update(logps=per_token_logps, entropy_mask=kw["entropy_mask"])
        return real(per_token_logps, *args, **kw)

    monkeypatch.setattr(grpo_mod, "grpo_loss", spy)
    module = _module(grpo_module, tokenizer, top_entropy_quantile=0.5)
    torch.manual_seed(0)
    module.training_step({"prompts": ["p"]}, 0).backward()
    mb = module.rollout_buffer.chunks[0]
    real_tokens = mb["completion_mask"].bool()
    keep = seen["entropy_mask"]
    _, ent = module.token_logps(module.model, mb, with_entropy=True)
    assert torch.equal(keep, (ent >= torch.quantile(ent[real_tokens], 0.5)) & real_tokens)
    grad = seen["logps"].grad
    assert (grad[real_tokens & ~keep] == 0).all() and 0 < keep.sum() < real_tokens.sum()
    assert (grad[keep] != 0).all()


# ---------------------------------------------------------------- rewards
def test_normalize_then_sum_by_hand():
    # two functions, two groups of two; weights 1 and 2
    per_func = torch.tensor([[1.0, 0.0], [3.0, 1.0], [2.0, 5.0], [2.0, 1.0]])
    # function 0: group 0 (1, 3) -> -+1/(sqrt2+1e-4); group 1 (2, 2) -> 0, 0
    # function 1: group 0 (0, 1) -> -+0.5/(0.70711+1e-4); group 1 (5, 1) -> +-2/(2.82843+1e-4)
    s2 = 2 ** 0.5
    f0 = [-1 / (s2 + 1e-4), 1 / (s2 + 1e-4), 0.0, 0.0]
    f1 = [-0.5 / (s2 / 2 + 1e-4), 0.5 / (s2 / 2 + 1e-4), 2 / (2 * s2 + 1e-4), -2 / (2 * s2 + 1e-4)]
    summed = [a + 2 * b for a, b in zip(f0, f1)]
    mean, std = statistics.mean(summed), statistics.stdev(summed)
    got = normalize_then_sum(per_func, torch.tensor([1.0, 2.0]), 2)
    assert got.tolist() == pytest.approx([(r - mean) / (std + 1e-4) for r in summed], rel=1e-5)
    other = [10.0, -4.0]  # another rank's summed rewards join the batch statistics
    got = normalize_then_sum(per_func, torch.tensor([1.0, 2.0]), 2, gather=lambda x: torch.cat([x, torch.tensor(other)]))
    mean, std = statistics.mean(summed + other), statistics.stdev(summed + other)
    assert got.tolist() == pytest.approx([(r - mean) / (std + 1e-4) for r in summed], rel=1e-5)


def test_score_with_normalize_then_sum_differs_from_sum_then_normalize(grpo_module):
    kw = dict(reward_funcs=[column_reward, other_reward], reward_weights=[1.0, 2.0])
    values, other = [1.0, 3.0, 2.0, 2.0], [0.0, 1.0, 5.0, 1.0]
    gdpo = grpo_module(multi_objective_aggregation="normalize_then_sum", num_generations=2, **kw)
    want = normalize_then_sum(torch.tensor([values, other]).T, torch.tensor([1.0, 2.0]), 2)
    got = advantages(gdpo, _rollout(values, other), _Stats())
    torch.testing.assert_close(got, want)
    plain = advantages(grpo_module(num_generations=2, **kw), _rollout(values, other), _Stats())
    assert not torch.allclose(plain, got)


def test_normalize_rewards_under_ddp_uses_every_ranks_rewards(grpo_module):
    module = grpo_module(reward_funcs=[column_reward], scale_rewards="none", normalize_rewards=True)
    mine, other_rank = [0.0, 1.0, 2.0, 5.0], [10.0, 20.0, 30.0, 40.0]
    module._trainer = SimpleNamespace(world_size=2, global_step=0)
    module.all_gather = lambda tensor: torch.stack([tensor, torch.tensor(other_rank)])
    got = advantages(module, _rollout(mine), _Stats())
    everything = mine + other_rank
    mean, std = statistics.mean(everything), statistics.pstdev(everything)
    normalized = [(v - mean) / std for v in mine]
    group_mean = statistics.mean(normalized)
    assert module.reward_normalizer.count == 8 and module.reward_normalizer.mean == pytest.approx(mean)
    assert got.tolist() == pytest.approx([v - group_mean for v in normalized], abs=1e-5)


# ---------------------------------------------------------------- generation
def test_validation_samples_num_generations_eval_per_prompt(grpo_module, tokenizer):
    module = _module(grpo_module, tokenizer, num_generations_eval=2)
    calls = []

    def generate(batch, num_generations):
        calls.append(num_generations)
        out = _rollout([1.0, 0.0])
        out["completion_mask"] = torch.ones(2, 3, dtype=torch.long)
        return out

    module.generate = generate
    module.eval()
    module.validation_step({"prompts": ["p"]}, 0)
    assert calls == [2] and module.eval_stats["reward__mean"].compute().item() == pytest.approx(0.5)


def test_generation_kwargs_reach_generate(grpo_module, tokenizer):
    from lightalign.datamodules.prompt import PromptCollator

    allowed = [tokenizer.convert_tokens_to_ids(t) for t in ("7", "3")] + [tokenizer.eos_token_id]
    suppress = [i for i in range(len(tokenizer)) if i not in allowed]
    module = grpo_module(generation_kwargs={"suppress_tokens": suppress}, share_prefill=False)
    module.configure_model()
    module.tokenizer = tokenizer
    batch = PromptCollator(tokenizer.pad_token_id)([{"prompt": "Q: 2+2=", "prompt_input_ids": tokenizer("Q: 2+2=")["input_ids"]}])
    torch.manual_seed(0)
    rollout = module.generate(batch, 4)
    ids = rollout["completion_ids"][rollout["completion_mask"].bool()]
    assert set(ids.tolist()) <= set(allowed)


# ---------------------------------------------------------------- chat_template_kwargs
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if hint %}{{ hint }}{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template(tiny_dir, write_jsonl, tokenizer):
    from lightalign import PromptDataModule

    path = write_jsonl([{"prompt": [{"role": "user", "content": "2+2?"}]}] * 2)
    dm = PromptDataModule(path, tokenizer=str(tiny_dir), chat_template=TEMPLATE, chat_template_kwargs={"hint": "Sure:"})
    dm.setup("fit")
    assert tokenizer.decode(dm.train_dataset[0]["prompt_input_ids"]).endswith("<|im_start|>assistant\nSure:")
    plain = PromptDataModule(path, tokenizer=str(tiny_dir), chat_template=TEMPLATE)
    plain.setup("fit")
    assert tokenizer.decode(plain.train_dataset[0]["prompt_input_ids"]).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        PromptDataModule(path, tokenizer=str(tiny_dir), chat_template_kwargs={"add_generation_prompt": False})


# ---------------------------------------------------------------- the console script
@pytest.mark.slow
def test_console_help_lists_the_knobs_and_a_bad_knob_is_one_clear_error(repo, tmp_path):
    from helpers import console_script

    help_page = console_script.run(repo, "fit", "--model.help", "lightalign.GRPOModule", timeout=300)
    assert help_page.returncode == 0, help_page.stderr[-2000:]
    for knob in ("importance_sampling_level", "delta", "sapo_temperature_neg", "vespo_lambda_pos",
                 "off_policy_mask_threshold", "use_bias_correction_kl", "top_entropy_quantile", "entropy_coef",
                 "use_adaptive_entropy", "entropy_target", "multi_objective_aggregation", "num_generations_eval",
                 "generation_kwargs", "cache_implementation"):
        assert f"--model.{knob}" in help_page.stdout, knob
    bad = console_script.run(repo, "fit", "--config", "configs/grpo_quickstart.yaml", "--model.loss_type", "cispo",
                             "--trainer.logger.init_args.save_dir", str(tmp_path), timeout=300)
    out = bad.stdout + bad.stderr
    assert bad.returncode == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("lightalign: error:")]
    assert len(errors) == 1 and "epsilon_high" in errors[0] and "Traceback" not in out, out[-3000:]
