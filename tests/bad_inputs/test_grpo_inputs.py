"""Bad prompts, reward functions and GRPO arithmetic: each stops with an error that names the culprit."""

from __future__ import annotations

import lightning as L
import pytest

from lightalign import GRPOModule, PromptDataModule
from lightalign.rewards import RewardFunctionError, digit_fraction_reward


def _trainer(**kw):
    kw.setdefault("max_steps", 2)
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **kw)


def _module(tiny_dir, **kw):
    kw.setdefault("reward_funcs", [digit_fraction_reward])
    kw.setdefault("num_generations", 4)
    kw.setdefault("max_completion_length", 6)
    kw.setdefault("learning_rate", 1e-3)
    return GRPOModule(str(tiny_dir), from_config=True, **kw)


def _data(tiny_dir, data_dir, **kw):
    return PromptDataModule(str(data_dir / "arithmetic_prompts.jsonl"), tokenizer=str(tiny_dir), max_prompt_length=16, **kw)


def test_bad_reward_function_stops_training_naming_it(tiny_dir, data_dir):
    batches = []

    def fragile_reward(prompts, completions, **kwargs):
        if len(completions) > 1:
            batches.append(list(completions))
        target = batches[0][5]
        return [1.0 / 0 if c == target else 0.0 for c in completions]

    module = _module(tiny_dir, reward_funcs=[fragile_reward], generation_batch_size=8)
    with pytest.raises(RewardFunctionError, match="fragile_reward") as err:
        _trainer(max_steps=1).fit(module, _data(tiny_dir, data_dir))
    first_bad = batches[0].index(batches[0][5])
    assert f"index {first_bad}" in str(err.value) or f"row {first_bad}" in str(err.value), str(err.value)

    def short_reward(prompts, completions, **kwargs):
        return [0.0]

    module = _module(tiny_dir, reward_funcs=[short_reward], generation_batch_size=8)
    with pytest.raises(RewardFunctionError, match=r"short_reward.*returned 1 values; expected 8"):
        _trainer(max_steps=1).fit(module, _data(tiny_dir, data_dir))

    def nan_reward(prompts, completions, **kwargs):
        return [float("nan")] * len(completions)

    module = _module(tiny_dir, reward_funcs=[nan_reward], generation_batch_size=8)
    with pytest.raises(RewardFunctionError, match="nan_reward"):
        _trainer(max_steps=1).fit(module, _data(tiny_dir, data_dir))


def test_invalid_generation_arithmetic_rejected_at_construction(tiny_dir):
    with pytest.raises(ValueError, match=r"generation_batch_size \(10\) must be divisible by num_generations \(4\): 10 = 2 x 4 \+ 2"):
        _module(tiny_dir, generation_batch_size=10)
    with pytest.raises(ValueError, match=r"split evenly into steps_per_generation \(3\)"):
        _module(tiny_dir, generation_batch_size=8, steps_per_generation=3)
    with pytest.raises(ValueError, match="unknown"):
        _module(tiny_dir, scale_rewards="rank")
    with pytest.raises(ValueError, match="num_generations must be >= 2"):
        _module(tiny_dir, num_generations=1)


def test_dapo_step_must_not_straddle_rollouts(tiny_dir, data_dir):
    module = _module(tiny_dir, generation_batch_size=12, steps_per_generation=3)
    with pytest.raises(ValueError, match=r"steps_per_generation \(3\) must be a multiple of accumulate_grad_batches \(2\)"):
        _trainer(max_steps=1, accumulate_grad_batches=2).fit(module, _data(tiny_dir, data_dir))


def test_prompt_data_errors(tiny_dir, write_jsonl):
    from lightalign import DataFormatError

    dm = PromptDataModule(write_jsonl([{"question": "1+1"}]), tokenizer=str(tiny_dir))
    with pytest.raises(DataFormatError, match=r"needs a 'prompt' column.*\['question'\]"):
        dm.setup("fit")
    dm = PromptDataModule(write_jsonl([{"prompt": "a"}, {"prompt": ""}]), tokenizer=str(tiny_dir))
    with pytest.raises(DataFormatError, match="row 1, column 'prompt': the text is empty"):
        dm.setup("fit")
