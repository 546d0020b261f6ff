"""Bad prompts, reward functions and GRPO arithmetic: each stops with an error that names the culprit."""

from __future__ import annotations

import pytest

from lightalign import PromptDataModule
from lightalign.rewards import RewardFunctionError


def test_bad_reward_function_stops_training_naming_it(tiny_dir, data_dir, quiet_trainer, grpo_module, prompt_data):
    batches = []

    def fragile_reward(prompts, completions, **kwargs):
        if len(completions) > 1:
            batches.append(list(completions))
        target = batches[0][5]
        return [1.0 / 0 if c == target else 0.0 for c in completions]

    module = grpo_module(reward_funcs=[fragile_reward], generation_batch_size=8)
    with pytest.raises(RewardFunctionError, match="fragile_reward") as err:
        quiet_trainer(max_steps=1).fit(module, prompt_data())
    first_bad = batches[0].index(batches[0][5])
    assert f"index {first_bad}" in str(err.value) or f"row {first_bad}" in str(err.value), str(err.value)

    def short_reward(prompts, completions, **kwargs):
        return [0.0]

    module = grpo_module(reward_funcs=[short_reward], generation_batch_size=8)
    with pytest.raises(RewardFunctionError, match=r"short_reward.*returned 1 values; expected 8"):
        quiet_trainer(max_steps=1).fit(module, prompt_data())

    def nan_reward(prompts, completions, **kwargs):
        return [float("nan")] * len(completions)

    module = grpo_module(reward_funcs=[nan_reward], generation_batch_size=8)
    with pytest.raises(RewardFunctionError, match="nan_reward"):
        quiet_trainer(max_steps=1).fit(module, prompt_data())


def test_invalid_generation_arithmetic_rejected_at_construction(tiny_dir, grpo_module):
    with pytest.raises(ValueError, match=r"generation_batch_size \(10\) must be divisible by num_generations \(4\): 10 = 2 x 4 \+ 2"):
        grpo_module(generation_batch_size=10)
    with pytest.raises(ValueError, match=r"split evenly into steps_per_generation \(3\)"):
        grpo_module(generation_batch_size=8, steps_per_generation=3)
    with pytest.raises(ValueError, match="unknown"):
        grpo_module(scale_rewards="rank")
    with pytest.raises(ValueError, match="GRPOModule needs num_generations >= 2"):
        grpo_module(num_generations=1)


def test_dapo_step_must_not_straddle_rollouts(tiny_dir, data_dir, quiet_trainer, grpo_module, prompt_data):
    module = grpo_module(generation_batch_size=12, steps_per_generation=3)
    with pytest.raises(ValueError, match=r"steps_per_generation \(3\) must be a multiple of accumulate_grad_batches \(2\)"):
        quiet_trainer(max_steps=1, accumulate_grad_batches=2).fit(module, prompt_data())


def test_prompt_data_errors(tiny_dir, write_jsonl):
    from lightalign import DataFormatError

    dm = PromptDataModule(write_jsonl([{"question": "1+1"}]), tokenizer=str(tiny_dir))
    with pytest.raises(DataFormatError, match=r"needs a 'prompt' column.*\['question'\]"):
        dm.setup("fit")
    dm = PromptDataModule(write_jsonl([{"prompt": "a"}, {"prompt": ""}]), tokenizer=str(tiny_dir))
    with pytest.raises(DataFormatError, match=r"^train data '.*', line 2: row 1, column 'prompt': the text is empty"):
        dm.setup("fit")  # the file's line beside the row (mutation: no row on the error -> no line, fails)
    dm = PromptDataModule(write_jsonl([{"prompt": "a", "answer": "1"}, {"question": "b", "answer": "2"}]),
                          tokenizer=str(tiny_dir))
    with pytest.raises(DataFormatError, match=r"^train data '.*', line 2: row 1, column 'prompt': missing or null; "
                                              "every row needs a string or a list of messages there"):
        dm.setup("fit")
    talk = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    dm = PromptDataModule(write_jsonl([{"messages": talk}, {"messages": talk}, {"messages": talk[:1]}]),
                          tokenizer=str(tiny_dir), val_split_size=0)
    with pytest.raises(DataFormatError, match=r"^train data '.*', line 3: row 2, column 'messages': a conversation is "
                                              "split into a prompt"):
        dm.setup("fit")
