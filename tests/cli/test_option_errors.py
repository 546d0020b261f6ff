"""Config and option errors in one line (#37): the file, line and key (or the option as typed), what was wrong, and
the close match of a misspelt name; exit 2, no usage dump, no traceback.

jsonargparse printed its ~100-line usage and a nested message that never named the YAML file. Every case refuses
while parsing, before the data or the model loads (a few seconds each through the console server).
"""

from __future__ import annotations

import pytest

from helpers import console_script

QUICKSTART = ("fit", "--config", "configs/quickstart.yaml")

# (name, YAML file text or None, extra arguments, the error line after "lightalign: error: "; {file} is the YAML file)
CASES = [
    ("unknown key in a file", "model:\n  init_args:\n    learning_rat: 1.0e-4\n", (),
     "{file}, line 3: SFTModule has no option 'learning_rat'; did you mean 'learning_rate'?"),
    ("wrong type in a file", "data:\n  init_args:\n    batch_size: 8\nmodel:\n  init_args:\n    learning_rate: abc\n", (),
     "{file}, line 6: 'model.learning_rate' expects float, got 'abc'."),
    ("YAML syntax", "model:\n  init_args:\n    learning_rate: [1\n  bad: : x\n", (),
     "{file}, line 4, column 6: invalid YAML (expected ',' or ']', but got ':'; while parsing a flow sequence)."),
    ("unknown trainer key in a file", "trainer:\n  max_stepz: 3\n", (),
     "{file}, line 2: unknown key 'trainer.max_stepz'; did you mean 'trainer.max_steps'?"),
    ("unknown knob typed", None, ("--model.learning_rat", "1e-4"),
     "SFTModule has no option --model.learning_rat; did you mean --model.learning_rate?"),
    ("wrong type typed", None, ("--data.batch_size", "x"), "--data.batch_size expects int, got 'x'."),
    ("unknown option typed", None, ("--trainer.max_stepz", "3"),
     "unknown option --trainer.max_stepz; did you mean --trainer.max_steps?"),
]


def run_with_override(repo, tmp_path, args, text, extra):
    """The console script on ``args``, then ``text`` (if any) as one more --config file, then ``extra``; returns (its
    output, the override file); exit status 2 (a parser error) checked."""
    file = tmp_path / "override.yaml"
    if text is not None:
        file.write_text(text)
        args = [*args, "--config", str(file)]
    proc = console_script.run(repo, *args, *extra, "--trainer.logger.init_args.save_dir", str(tmp_path), timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    return out, file


@pytest.mark.slow
@pytest.mark.parametrize("name, text, extra, expected", CASES, ids=[c[0] for c in CASES])
def test_config_and_option_errors_are_one_line(repo, tmp_path, name, text, extra, expected):
    out, file = run_with_override(repo, tmp_path, list(QUICKSTART), text, extra)
    errors = [line for line in out.splitlines() if line.startswith("lightalign: error:")]
    assert errors == [f"lightalign: error: {expected.format(file=file)}"], out[-4000:]
    assert "usage:" not in out and "Traceback" not in out and "tip:" not in out, out[-4000:]


@pytest.mark.slow
def test_a_wrong_type_for_an_online_rl_knob_names_it(repo, tmp_path):
    """The issue's `--model.max_staleness 1.5` (GRPO's int knob), and a knob another method has."""
    proc = console_script.run(repo, "fit", "--config", "configs/grpo_quickstart.yaml", "--model.max_staleness", "1.5",
                              "--trainer.logger.init_args.save_dir", str(tmp_path), timeout=600)
    assert proc.returncode == 2 and "usage:" not in proc.stderr, proc.stderr[-4000:]
    assert "lightalign: error: --model.max_staleness expects int, got '1.5'." in proc.stderr.splitlines(), proc.stderr


@pytest.mark.slow
def test_a_trl_knob_name_points_to_the_methods_knob_and_choices_are_listed(repo, tmp_path):
    """TRL GKD's `max_new_tokens` names DistillModule's `max_completion_length` (its knob_equivalents; mutation: the
    lookup dropped -> no pointer); a Literal knob's refusal lists its choices (mutation: the raw typing.Literal); a
    data option given to the model is pointed to the data section."""
    distill = ["fit", "--config", "configs/distill_quickstart.yaml", "--model.teacher_model_name_or_path",
               "assets/models/tiny", "--trainer.logger.init_args.save_dir", str(tmp_path)]
    for extra, expected in [
            (("--model.max_new_tokens", "8"), "DistillModule has no option --model.max_new_tokens; its "
                                              "--model.max_completion_length is the same idea"),
            (("--model.loss_type", "kl"), "--model.loss_type expects one of 'gkd', 'on_policy', got 'kl'."),
            # TRL's configs hold the data options beside the method's: pointed to the data section (mutation:
            # data_options() empty -> "did you mean --model.max_completion_length?")
            (("--model.max_prompt_length", "32"), "DistillModule has no option --model.max_prompt_length; it is an "
                                                  "option of the data here: --data.max_prompt_length")]:
        proc = console_script.run(repo, *distill, *extra, timeout=600)
        assert proc.returncode == 2 and "usage:" not in proc.stderr, proc.stderr[-4000:]
        assert f"lightalign: error: {expected}" in proc.stderr.splitlines(), proc.stderr[-4000:]


# (name, base config, YAML override or None, extra arguments, the error line after "lightalign: error: ")
UNION_CASES = [
    ("float or None typed", "configs/distill_quickstart.yaml", None, ("--model.lmbda", "half"),
     "--model.lmbda expects a float or null, got 'half'."),
    ("float or list typed", "configs/online_dpo_quickstart.yaml", None, ("--model.beta", "abc"),
     "--model.beta expects a float or a list of floats, got 'abc'."),
    ("float or None in a file", "configs/distill_quickstart.yaml",
     "model:\n  init_args:\n    beta: 0.5\n    lmbda: 0.5.5\n", (),
     "{file}, line 4: 'model.lmbda' expects a float or null, got '0.5.5'."),
    ("missing config file", "configs/distill_quickstar.yaml", None, (),
     "config file 'configs/distill_quickstar.yaml' does not exist; did you mean configs/distill_quickstart.yaml?"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, config, text, extra, expected", UNION_CASES, ids=[c[0] for c in UNION_CASES])
def test_union_knobs_and_a_missing_config_are_one_line(repo, tmp_path, name, config, text, expected, extra):
    """A knob typed as a Union (DistillModule's `lmbda: float | None`, OnlineDPOModule's `beta: float | list[float]`)
    is refused like a plain one, typed or in a file (its line), not with jsonargparse's list of the subtypes' errors;
    a --config file that is not there in one line (not three), with the close name in its folder."""
    out, file = run_with_override(repo, tmp_path, ["fit", "--config", config], text, extra)
    assert out.splitlines()[0] == f"lightalign: error: {expected.format(file=file)}", out[-4000:]
    assert len(out.splitlines()) == 1 and "Traceback" not in out, out[-4000:]


@pytest.mark.slow
def test_trls_former_knob_name_names_the_current_one(repo, tmp_path):
    """``vllm_importance_sampling_cap`` (TRL's former name) points to ``..._clip_max``, not to the closest spelling
    (``..._clip_min``, the other bound)."""
    proc = console_script.run(repo, "fit", "--config", "configs/grpo_quickstart.yaml",
                              "--model.vllm_importance_sampling_cap", "2",
                              "--trainer.logger.init_args.save_dir", str(tmp_path), timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert ("lightalign: error: GRPOModule has no option --model.vllm_importance_sampling_cap; it is TRL's former name "
            "of --model.vllm_importance_sampling_clip_max: use that") in out, out[-4000:]
