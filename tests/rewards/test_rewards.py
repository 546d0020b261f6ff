"""Reward functions, their runner (TRL semantics), advantages, normalization and the reward-model wrapper."""

from __future__ import annotations

import math
import statistics
import sys

import numpy as np
import pytest
import torch

from lightalign.modules.losses.advantages.reward_shaping import check_reward_shaping
from lightalign.modules.losses.advantages import RunningRewardNormalizer, clip_rewards, scale_advantages, zero_std_fraction
from lightalign.rewards import (
    FormatReward,
    LengthPenalty,
    RewardFunctionError,
    RewardModel,
    accuracy_reward,
    check_reward_weights,
    completion_text,
    compute_rewards,
    digit_fraction_reward,
    make_format_reward,
    resolve_reward_funcs,
    reward_func_name,
    reward_func_names,
    think_format_reward,
)


def chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.fixture(params=["standard", "conversational"])
def as_completion(request):
    return (lambda t: t) if request.param == "standard" else chat


# ---------------------------------------------------------------- built-in reward functions


def test_completion_text_forms():
    assert completion_text("abc") == "abc"
    assert completion_text(chat("abc")) == "abc"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]) == "a"


def test_accuracy_reward(as_completion):
    completions = [as_completion(t) for t in ["  42 ", "The answer is 1,234.", "x = -5", "It is 7", "2.50", "anything"]]
    answers = ["42", "1234", "-5", "8", "2.5", None]
    assert accuracy_reward(None, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 1.0, None]
    # exact text match for non-numeric answers, the last number counts, "3-5" is not -5, empty answer -> None
    completions = [as_completion(t) for t in ["Paris", "first 3 then 9", "3-5", "whatever"]]
    assert accuracy_reward(None, completions, answer=["Paris", "3", "-5", "  "]) == [1.0, 0.0, 0.0, None]
    assert accuracy_reward(None, [as_completion("1000")], answer=["1,000"]) == [1.0]
    assert accuracy_reward(None, [as_completion("1000.0000001")], answer=[1000]) == [1.0]
    assert accuracy_reward(None, [as_completion("7")], solution=["7"]) == [1.0]  # TRL's column name
    with pytest.raises(ValueError, match="'answer'"):
        accuracy_reward(None, [as_completion("7")])


def test_think_format_reward_matches_trl_pattern(as_completion):
    texts = ["<think>\nreasoning\n</think>\nanswer", "<think>\nreasoning\nanswer", "answer <think>x</think>",
             "<think>a</think><think>b</think>c", "<think></think>"]
    assert think_format_reward(None, [as_completion(t) for t in texts]) == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_format_reward_factory_and_class(as_completion):
    fn = make_format_reward(r"Answer: \d+")
    assert fn(None, [as_completion("Answer: 12"), as_completion("Answer: 12!"), as_completion("answer: 1")]) == [1.0, 0.0, 0.0]
    assert reward_func_name(fn) == "format_reward"
    multi = FormatReward(r"a.b", flags="DOTALL", name="ab")
    assert multi(None, ["a\nb"]) == [1.0] and reward_func_name(multi) == "ab"
    assert FormatReward(r"a.b", flags=0)(None, ["a\nb"]) == [0.0]
    with pytest.raises(ValueError, match="not a valid regular expression"):
        FormatReward("(")
    with pytest.raises(ValueError, match="Unknown regex flag"):
        FormatReward("a", flags="DOTAL")


def test_length_penalty(as_completion):
    penalty = LengthPenalty(max_length=5, penalty=0.5)
    assert penalty(None, [as_completion("abc"), as_completion("abcdefgh")]) == [0.0, -1.5]
    words = LengthPenalty(max_length=2, penalty=1.0, unit="words")
    assert words(None, [as_completion("one two three four")]) == [-2.0]
    tokens = LengthPenalty(max_length=1, penalty=1.0, unit="tokens")
    assert tokens(None, ["x"], completion_ids=[[1, 2, 3]]) == [-2.0]
    assert reward_func_name(penalty) == "length_penalty"
    with pytest.raises(ValueError, match="unit"):
        LengthPenalty(unit="bytes")


def test_digit_fraction_reward(as_completion):
    out = digit_fraction_reward(None, [as_completion(t) for t in ["123", "1a 2b", "", "   ", "abc"]])
    assert out == [1.0, 0.5, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------- compute_rewards: TRL semantics


def trl_style_reward(completions, difficulty, **kwargs):
    """Written for TRL: keyword-only use of completions, an extra column, **kwargs for the rest."""
    contents = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [len(text) * d for text, d in zip(contents, difficulty)]


def test_trl_reward_function_runs_unchanged():
    prompts = [[{"role": "user", "content": "hi"}]] * 2
    per_func, total, _ = compute_rewards(
        [trl_style_reward], prompts, [chat("ab"), chat("abc")], columns={"difficulty": [1, 2], "trainer_state": object()}
    )
    assert per_func.tolist() == [[2.0], [6.0]] and total.tolist() == [2.0, 6.0]


def test_none_is_nansum_with_weights():
    def half(prompts, completions, **kw):
        return [1.0, None, 3.0, None]

    def other(prompts, completions, **kw):
        return [10.0, 20.0, None, None]

    with pytest.warns(RuntimeWarning, match="index 3"):
        per_func, total, _ = compute_rewards([half, other], ["p"] * 4, ["c"] * 4, weights=[2.0, 0.5])
    assert torch.equal(torch.isnan(per_func), torch.tensor([[False, False], [True, False], [False, True], [True, True]]))
    assert total[:3].tolist() == [7.0, 10.0, 6.0]
    assert math.isnan(total[3].item())  # unscorable: NaN total, advantage 0 below (TRL)
    adv = scale_advantages(total, num_generations=4, scale_rewards="none")
    assert adv[3].item() == 0.0 and adv[:3].tolist() == pytest.approx([-0.6667, 2.3333, -1.6667], abs=1e-4)


def test_tensor_numpy_and_async_outputs():
    async def judge(prompts, completions, **kw):
        return [0.5] * len(completions)

    funcs = [lambda prompts, completions, **kw: torch.ones(2), lambda prompts, completions, **kw: np.zeros(2), judge]
    per_func, total, _ = compute_rewards(funcs, ["p", "q"], ["a", "b"])
    assert total.tolist() == [1.5, 1.5]
    assert reward_func_names(funcs) == ["<lambda>", "<lambda>_1", "judge"]


# ---------------------------------------------------------------- resolution


def test_resolve_import_paths(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def shout(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    funcs = resolve_reward_funcs(
        ["lightalign.rewards.accuracy_reward", "lightalign.rewards:think_format_reward", "my_rewards:shout",
         "my_rewards.shout", "digit_fraction_reward", digit_fraction_reward, "lightalign.rewards.LengthPenalty",
         {"class_path": "lightalign.rewards.FormatReward", "init_args": {"pattern": "x", "name": "x_only"}}]
    )
    assert funcs[:2] == [accuracy_reward, think_format_reward] and funcs[4] is digit_fraction_reward
    assert funcs[2].__name__ == funcs[3].__name__ == "shout"
    assert isinstance(funcs[6], LengthPenalty)
    assert reward_func_names(funcs)[-4:] == ["digit_fraction_reward", "digit_fraction_reward_1", "length_penalty", "x_only"]
    assert resolve_reward_funcs(None) == [] and resolve_reward_funcs(think_format_reward) == [think_format_reward]


def test_resolve_from_current_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards_pkg").mkdir()
    (tmp_path / "cwd_rewards_pkg" / "rw.py").write_text("def f(prompts, completions, **kw):\n    return [0.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert resolve_reward_funcs("cwd_rewards_pkg.rw.f")[0].__name__ == "f"


# ---------------------------------------------------------------- advantages, normalization, clipping

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])


def test_scale_advantages_group_batch_none():
    centred = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    group_std = statistics.stdev([1.0, 0.0, 0.0, 1.0])  # unbiased, as TRL
    batch_std = statistics.stdev(REWARDS.tolist())
    assert scale_advantages(REWARDS, 4, "none").tolist() == centred
    assert scale_advantages(REWARDS, 4, "group").tolist() == pytest.approx([c / (group_std + 1e-4) for c in centred])
    assert scale_advantages(REWARDS, 4, "batch").tolist() == pytest.approx([c / (batch_std + 1e-4) for c in centred])
    assert scale_advantages(REWARDS, 4, True).tolist() == scale_advantages(REWARDS, 4, "group").tolist()
    assert zero_std_fraction(REWARDS, 4) == 0.5
    assert scale_advantages(REWARDS, 1, "group").tolist() == [0.0] * 8
    with pytest.raises(ValueError, match=r"'group', 'batch', 'none'"):
        scale_advantages(REWARDS, 4, "grop")
    with pytest.raises(ValueError, match="groups of num_generations=3"):
        scale_advantages(REWARDS, 3)


def test_batch_scaling_divides_by_the_std_of_the_whole_generation_batch():
    # this rank holds REWARDS; another rank's completions scored far apart: "batch" divides by the std of all 16
    other = torch.tensor([10.0, 20.0, 30.0, 40.0, 0.0, 5.0, 5.0, 0.0])
    everyone = torch.cat([REWARDS, other])
    centred = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    global_std = statistics.stdev(everyone.tolist())
    got = scale_advantages(REWARDS, 4, "batch", batch_rewards=everyone)
    assert got.tolist() == pytest.approx([c / (global_std + 1e-4) for c in centred])
    # the group means stay local, and "group" ignores the batch
    assert scale_advantages(REWARDS, 4, "group", batch_rewards=everyone).tolist() == \
        scale_advantages(REWARDS, 4, "group").tolist()


def test_running_normalizer_matches_numpy_and_round_trips():
    a, b = torch.tensor([1.0, 2.0, 4.0]), torch.tensor([-3.0, 0.5, 8.0, 10.0, float("nan")])
    norm = RunningRewardNormalizer(eps=0.0)
    norm.normalize(a)
    out = norm.normalize(b)
    seen = np.concatenate([a.numpy(), b.numpy()[:4]])
    assert norm.count == 7 and norm.mean == pytest.approx(seen.mean()) and norm.var == pytest.approx(seen.var())
    assert out[:4].tolist() == pytest.approx(((b.numpy()[:4] - seen.mean()) / seen.std()).tolist(), rel=1e-6)
    assert math.isnan(out[4].item())
    restored = RunningRewardNormalizer()
    restored.load_state_dict(norm.state_dict())
    assert restored.state_dict() == norm.state_dict()
    assert all(isinstance(v, float) for v in norm.state_dict().values())


def test_clip_rewards():
    assert clip_rewards(torch.tensor([-5.0, 0.5, 5.0]), 1.0).tolist() == [-1.0, 0.5, 1.0]
    assert clip_rewards(REWARDS, None) is REWARDS
    with pytest.raises(ValueError, match="positive"):  # checked once, where the knob is configured
        check_reward_shaping("group", False, 0.0, "sum_then_normalize")


# ---------------------------------------------------------------- reward model


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_dir):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from lightalign.hub import load_tokenizer

    config = AutoConfig.from_pretrained(str(tiny_dir), num_labels=1, pad_token_id=0)
    config.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    out = tmp_path_factory.mktemp("reward_model")
    model.save_pretrained(out)
    load_tokenizer(str(tiny_dir)).save_pretrained(out)
    return out


def test_reward_model_scores_standard_and_conversational(reward_model_dir):
    (rm,) = resolve_reward_funcs([str(reward_model_dir)])
    assert isinstance(rm, RewardModel) and reward_func_name(rm) == reward_model_dir.name
    rm.batch_size = 2  # 3 rows -> two forward passes with padding
    prompts, completions = ["What is 2+2? ", "Hi", "Say something long please "], ["4", "hello there", "ok " * 10]
    first = rm(prompts, completions)
    assert len(first) == 3 and all(isinstance(r, float) and math.isfinite(r) for r in first)
    assert rm(prompts, completions) == first
    # batching and right padding do not change a row's score
    assert RewardModel(str(reward_model_dir), batch_size=1)(prompts, completions) == pytest.approx(first, abs=1e-5)
    conv = [[{"role": "user", "content": p}] for p in prompts]
    per_func, total, _ = compute_rewards([rm], conv, [chat(c) for c in completions])
    assert torch.isfinite(total).all() and total.shape == (3,)
    assert "<|im_start|>assistant" in rm.texts(conv[:1], [chat("4")])[0]
