"""Reward functions cannot stall a run (#34): the functions of a rollout run at once, each call within
``reward_timeout``; a call that hangs or raises is an error naming the function (and the row, found within bounded
time), or, with ``reward_fallback_value``, scores with that value and is counted; a rollout no function scored at all
is an error."""

from __future__ import annotations

import asyncio
import math
import threading
import time
import warnings
from types import SimpleNamespace

import pytest
import torch

from helpers.rewards import hangs_forever
from lightalign.modules.rollout.scoring import metric_key
from lightalign.rewards import FallbackReport, RewardFunctionError, compute_rewards

PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = ["c0", "c1", "c2", "c3"]


def constant(prompts, completions, **kwargs):
    return [1.0] * len(completions)


async def hangs_forever_async(prompts, completions, **kwargs):
    await asyncio.Event().wait()


def judge_unreachable(prompts, completions, **kwargs):
    raise ConnectionError("judge unreachable")


def seconds_since(start: float) -> float:
    return time.monotonic() - start


# ---------------------------------------------------------------- time limit and concurrency
@pytest.mark.parametrize("hanging", [hangs_forever, hangs_forever_async])
def test_a_hanging_function_is_an_error_naming_it_within_its_timeout(hanging):
    start = time.monotonic()
    with pytest.raises(RewardFunctionError) as info:
        compute_rewards([constant, hanging], PROMPTS, COMPLETIONS, reward_timeout=0.3)
    assert seconds_since(start) < 2.0
    message = str(info.value)
    assert f"'{hanging.__name__}' did not return within 0.3 s on a call of 4 completions" in message
    assert "raise model.reward_timeout" in message and "\n" not in message


def test_the_functions_of_a_rollout_run_at_once():
    """Each function waits for the other at a barrier: called one after the other, the first would wait alone and
    the barrier break after 2 s."""
    barrier = threading.Barrier(2, timeout=2)

    def meets_the_other(prompts, completions, **kwargs):
        barrier.wait()
        return [1.0] * len(completions)

    def meets_the_first(prompts, completions, **kwargs):
        barrier.wait()
        return [2.0] * len(completions)

    per_func, total, fallbacks = compute_rewards([meets_the_other, meets_the_first], PROMPTS, COMPLETIONS,
                                                 reward_timeout=10)
    assert total.tolist() == [3.0] * 4 and fallbacks == {}


def test_async_functions_still_work_beside_plain_ones():
    async def judge(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [0.5] * len(completions)

    per_func, total, _ = compute_rewards([judge, constant], PROMPTS, COMPLETIONS, reward_timeout=5)
    assert total.tolist() == [1.5] * 4


def test_functions_run_in_the_callers_grad_and_inference_mode():
    seen = []

    def records_the_mode(prompts, completions, **kwargs):
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return [0.0] * len(completions)

    with torch.no_grad():
        compute_rewards([records_the_mode, constant], PROMPTS, COMPLETIONS, reward_timeout=5)
    with torch.inference_mode():
        compute_rewards([records_the_mode, constant], PROMPTS, COMPLETIONS, reward_timeout=5)
    compute_rewards([records_the_mode, constant], PROMPTS, COMPLETIONS, reward_timeout=5)
    assert seen == [(False, False), (False, True), (True, False)]


# ---------------------------------------------------------------- finding the failing row within bounded time
def test_the_row_search_after_a_raise_names_a_row_that_hangs():
    """The batch call raises; called alone, rows 0-2 succeed and row 3 hangs: the error names row 3, in bounded
    time."""

    def refuses_batches_hangs_on_c3(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("grader refused the batch")
        if completions[0] == "c3":
            threading.Event().wait()
        return [1.0]

    start = time.monotonic()
    with pytest.raises(RewardFunctionError) as info:
        compute_rewards([refuses_batches_hangs_on_c3], PROMPTS, COMPLETIONS, reward_timeout=0.3)
    assert seconds_since(start) < 2.0
    message = str(info.value)
    assert "'refuses_batches_hangs_on_c3' raised RuntimeError('grader refused the batch') on the batch of 4" in message
    assert "ran out of its 0.3 s (model.reward_timeout) at index 3 (prompt 'p3', completion 'c3')" in message


def test_the_row_search_takes_the_timeout_in_all():
    """30 rows that take 0.2 s each alone (6 s one by one): the search stops after the 0.5 s limit."""

    def refuses_batches_slow_alone(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("grader refused the batch")
        time.sleep(0.2)
        return [1.0]

    start = time.monotonic()
    with pytest.raises(RewardFunctionError, match=r"ran out of its 0.5 s \(model.reward_timeout\) at index \d+"):
        compute_rewards([refuses_batches_slow_alone], ["p"] * 30, ["c"] * 30, reward_timeout=0.5)
    assert seconds_since(start) < 3.0


def test_without_a_limit_the_row_search_still_names_the_raising_row():
    def fails_on_c2(prompts, completions, **kwargs):
        return [1.0 / (c != "c2") for c in completions]

    with pytest.raises(RewardFunctionError, match=r"'fails_on_c2' raised ZeroDivisionError at index 2 \(prompt 'p2'"):
        compute_rewards([fails_on_c2], PROMPTS, COMPLETIONS, reward_timeout=None)


# ---------------------------------------------------------------- fallback
def test_fallback_scores_every_row_of_a_call_that_raises_or_hangs_and_counts_them():
    start = time.monotonic()
    per_func, total, fallbacks = compute_rewards([constant, judge_unreachable, hangs_forever], PROMPTS, COMPLETIONS,
                                                 reward_timeout=0.3, reward_fallback_value=-1.0)
    assert seconds_since(start) < 2.0
    assert per_func.tolist() == [[1.0, -1.0, -1.0]] * 4 and total.tolist() == [-1.0] * 4
    assert fallbacks == {
        "judge_unreachable": FallbackReport(4, 0, "raised ConnectionError('judge unreachable') on a call of 4 "
                                                  "completions"),
        "hangs_forever": FallbackReport(4, 0, "did not return within 0.3 s on a call of 4 completions"),
    }


def test_fallback_replaces_nan_and_inf_but_none_still_means_not_applicable():
    def sometimes_not_finite(prompts, completions, **kwargs):
        return [0.5, math.nan, None, -math.inf]

    with pytest.warns(RuntimeWarning, match="1 of 4 completions, first at index 2"):
        per_func, total, fallbacks = compute_rewards([sometimes_not_finite], PROMPTS, COMPLETIONS,
                                                     reward_fallback_value=0.0)
    assert per_func[[0, 1, 3], 0].tolist() == [0.5, 0.0, 0.0] and math.isnan(per_func[2, 0])
    assert math.isnan(total[2]) and total[[0, 1, 3]].tolist() == [0.5, 0.0, 0.0]
    assert fallbacks == {"sometimes_not_finite": FallbackReport(2, 1, "returned nan at index 1")}


@pytest.mark.parametrize(("output", "match"), [([1.0, 2.0], "returned 2 values; expected 4"),
                                               (1.0, "returned a float; expected a list of 4"),
                                               ([1.0, "good", 0.0, 0.0], "non-numeric value 'good' at index 1")])
def test_a_result_of_the_wrong_shape_or_type_is_an_error_even_with_a_fallback(output, match):
    def buggy(prompts, completions, **kwargs):
        return output

    with pytest.raises(RewardFunctionError, match=rf"'buggy' .*{match}"):
        compute_rewards([constant, buggy], PROMPTS, COMPLETIONS, reward_fallback_value=0.0)


# ---------------------------------------------------------------- a rollout nothing scored
@pytest.mark.parametrize("fallback", [None, 0.0])
def test_a_rollout_no_function_scored_is_an_error_naming_the_functions(fallback):
    def not_applicable(prompts, completions, **kwargs):
        return [None] * len(completions)

    def needs_an_answer(prompts, completions, answer=None, **kwargs):
        return [None] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"No completion of the rollout has a reward: reward function\(s\) "
                                                  r"\['not_applicable', 'needs_an_answer'\] returned None for all 4 "
                                                  r"completions.*this batch has \['difficulty'\]"):
        compute_rewards([not_applicable, needs_an_answer], PROMPTS, COMPLETIONS, {"difficulty": [1, 2, 3, 4]},
                        reward_fallback_value=fallback)


# ---------------------------------------------------------------- the knobs on the module
@pytest.mark.parametrize(("knobs", "match"), [
    ({"reward_timeout": 0}, "reward_timeout must be a positive number of seconds"),
    ({"reward_timeout": -1.0}, "reward_timeout must be a positive number of seconds"),
    ({"reward_timeout": math.inf}, "reward_timeout must be a positive number of seconds"),
    ({"reward_fallback_value": math.nan}, "reward_fallback_value must be a finite number"),
    ({"reward_fallback_value": math.inf}, "reward_fallback_value must be a finite number"),
])
def test_knobs_out_of_range_are_refused_at_construction(grpo_module, knobs, match):
    with pytest.raises(ValueError, match=match):
        grpo_module(**knobs)


def test_the_scoring_stage_counts_fallbacks_per_function_and_warns_once_per_function(grpo_module):
    module = grpo_module(reward_funcs=[constant, judge_unreachable], reward_fallback_value=0.0, reward_timeout=5)
    assert module.hparams.reward_timeout == 5 and grpo_module().hparams.reward_timeout == 300.0
    assert [n for n in module.stat_names if n.endswith("/fallbacks")] == ["reward/constant/fallbacks",
                                                                          "reward/judge_unreachable/fallbacks"]
    assert not [n for n in grpo_module().stat_names if n.endswith("/fallbacks")]  # without the knob: not logged
    module._trainer = SimpleNamespace(world_size=1, global_step=0)
    rollout = {"prompts": PROMPTS, "completions": COMPLETIONS, "texts": COMPLETIONS, "columns": {},
               "completion_mask": torch.ones(4, 3, dtype=torch.long), "truncated": torch.zeros(4, dtype=torch.bool)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # every warning recorded, even one identical to an earlier one
        module.score(rollout, module.train_stats)
        module.score(rollout, module.train_stats)
    warned = [str(w.message) for w in record if "judge_unreachable" in str(w.message)]
    assert len(warned) == 1, warned
    assert warned[0].startswith("Reward function 'judge_unreachable' raised ConnectionError('judge unreachable') on "
                                "a call of 4 completions: 4 of the 4 completions of this rollout got "
                                "reward_fallback_value 0 instead (the first: index 0, prompt 'p0')")
    assert module.train_stats[metric_key("reward/judge_unreachable/fallbacks")].compute() == 4.0
    assert module.train_stats[metric_key("reward/constant/fallbacks")].compute() == 0.0


# ---------------------------------------------------------------- through the console script
@pytest.mark.slow
def test_a_hanging_reward_function_ends_the_console_script_with_one_error_line(repo, tmp_path):
    """`lightalign fit` with a reward function that never returns and `--model.reward_timeout 2`: exit status 1 well
    within the subprocess limit, one `lightalign: error:` line naming the function and the limit, no traceback."""
    from helpers import console_script

    start = time.monotonic()
    proc = console_script.run(  # from tests/, where helpers.rewards is importable (the current directory)
        repo / "tests", "fit", "--config", str(repo / "configs" / "grpo_quickstart.yaml"),
        "--model.model_name_or_path", str(repo / "assets" / "models" / "tiny"),
        "--data.path", str(repo / "examples" / "data" / "arithmetic_prompts.jsonl"),
        "--model.reward_funcs", "[helpers.rewards.hangs_forever]", "--model.reward_timeout", "2",
        "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--plot.enabled", "false",
        "--trainer.logger.init_args.save_dir", str(tmp_path), timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lightalign: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("Reward function 'hangs_forever' did not return within 2 s on a call of 32 completions" in errors[0]
            and "raise model.reward_timeout" in errors[0]), errors[0]
    assert seconds_since(start) < 120


def test_a_function_that_exits_is_an_error_naming_it():
    """argparse inside a reward function exits on a bad argument: the run names the function instead of ending
    silently with the function's exit status."""

    def parses_args(prompts, completions, **kwargs):
        raise SystemExit(4)

    with pytest.raises(RewardFunctionError, match=r"'parses_args' called sys.exit\(4\) instead of returning"):
        compute_rewards([constant, parses_args], PROMPTS, COMPLETIONS, reward_timeout=5)
