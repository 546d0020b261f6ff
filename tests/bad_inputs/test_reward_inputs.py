"""Bad reward functions and reward specs: every error names the function (and the failing row)."""

from __future__ import annotations

import pytest

from lightalign.rewards import (
    RewardFunctionError,
    accuracy_reward,
    check_reward_weights,
    compute_rewards,
    digit_fraction_reward,
    resolve_reward_funcs,
)


def trl_style_reward(completions, difficulty, **kwargs):
    return [float(d) for d in difficulty]


def test_missing_column_is_named():
    with pytest.raises(RewardFunctionError, match=r"trl_style_reward.*difficulty"):
        compute_rewards([trl_style_reward], ["p"], ["c"], columns={})
    with pytest.raises(RewardFunctionError, match=r"'accuracy_reward' raised ValueError at index 0.*'answer'"):
        compute_rewards([accuracy_reward], ["p"], ["c"], columns={"other": ["x"]})
    with pytest.raises(ValueError, match="Column 'answer' has 1 values for 2 completions"):
        compute_rewards([accuracy_reward], ["p", "q"], ["c", "d"], columns={"answer": ["x"]})


def test_weights_must_match():
    with pytest.raises(ValueError, match="2 values but there are 1 reward functions"):
        check_reward_weights([digit_fraction_reward], [1.0, 2.0])
    assert check_reward_weights([digit_fraction_reward], None).tolist() == [1.0]


def test_function_that_raises_names_function_and_row():
    def fails_on_row_two(prompts, completions, **kw):
        return [1.0 / (0 if c == "boom" else 1) for c in completions]

    prompts = ["p0", "p1", "the third prompt", "p3"]
    with pytest.raises(RewardFunctionError, match=r"'fails_on_row_two' raised ZeroDivisionError at index 2") as info:
        compute_rewards([fails_on_row_two], prompts, ["a", "b", "boom", "d"])
    assert "the third prompt" in str(info.value)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize(
    ("output", "match"),
    [
        ([1.0, 2.0], "returned 2 values; expected 3"),
        (1.0, "returned a float; expected a list of 3"),
        ([1.0, float("nan"), 0.0], "returned nan at index 1"),
        ([1.0, 0.0, float("inf")], "returned inf at index 2"),
        ([1.0, "good", 0.0], "non-numeric value 'good' at index 1"),
    ],
)
def test_bad_outputs_are_named(output, match):
    def bad_reward(prompts, completions, **kw):
        return output

    with pytest.raises(RewardFunctionError, match=rf"'bad_reward'.*{match}"):
        compute_rewards([digit_fraction_reward, bad_reward], ["p"] * 3, ["1", "2", "3"])


def test_resolve_errors(tmp_path):
    with pytest.raises(ImportError, match=r"no_such_pkg.*Tried: module 'no_such_pkg.mod' \(not found\)"):
        resolve_reward_funcs("no_such_pkg.mod.fn")
    with pytest.raises(ImportError, match="no_such_fn"):
        resolve_reward_funcs("lightalign.rewards:no_such_fn")
    with pytest.raises(TypeError, match="not callable"):
        resolve_reward_funcs("lightalign.rewards.functions.__all__")
    with pytest.raises(TypeError, match="needs arguments"):
        resolve_reward_funcs("lightalign.rewards.FormatReward")
    with pytest.raises(ValueError, match="without config.json"):
        resolve_reward_funcs(str(tmp_path))
    with pytest.raises(ValueError, match="no model folder"):
        resolve_reward_funcs(str(tmp_path / "missing"))


def test_a_reward_import_path_that_leads_nowhere_is_one_line_through_the_console_script(repo, tmp_path):
    """A typo in a reward function's import path: one `lightalign: error:` line naming the path and where it looked
    (mutation: RewardImportError left out of cli.is_user_error -> a traceback). A module next to the config that
    exists but lacks the name is reported as such, not as 'not found'."""
    from helpers import console_script

    (tmp_path / "myrewards.py").write_text("def answer_reward(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n")
    proc = console_script.run(tmp_path, "fit", "--config", str(repo / "configs" / "grpo_quickstart.yaml"),
                              "--model.model_name_or_path", str(repo / "assets" / "models" / "tiny"),
                              "--data.path", str(repo / "examples" / "data" / "arithmetic_prompts.jsonl"),
                              "--model.reward_funcs", "[myrewards.answer_rewrd]",
                              "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lightalign: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Cannot import reward function 'myrewards.answer_rewrd'" in errors[0]
    assert "'answer_rewrd' in module 'myrewards'" in errors[0] and "(not found)" not in errors[0]
