"""The run callbacks' numeric knobs (``--checkpoint.*``, ``--completions.*``, ``--progress_bar.*``, ``--throughput.*``,
``--export.*``, ``--hub.*``: ``lightalign.trainer.RUN_CALLBACKS``) refuse a value out of range at construction, in one
line naming the console option ``--<group>.<knob>``, the value and the valid range (issue 48).

A new-user trial's ``--completions.every_n_steps 0`` printed ``every_n_steps and max_rows must be >= 1.``, naming
neither the group nor which knob; ``--checkpoint.every_n_train_steps -1`` printed Lightning's traceback.
"""

from __future__ import annotations

import inspect
import typing

import pytest

from helpers import console_script
from lightalign.trainer import RUN_CALLBACKS

# (group, knob, a value out of range, the range in the message)
OUT_OF_RANGE = [
    ("checkpoint", "every_n_train_steps", -1, "an integer >= 0 (or unset)"),
    ("checkpoint", "every_n_epochs", -1, "an integer >= 0 (or unset)"),
    ("checkpoint", "save_top_k", -2, "an integer >= -1 (or unset)"),
    ("export", "every_n_train_steps", -1, "an integer >= 0"),
    ("throughput", "peak_flops", 0.0, "a number > 0 (or unset)"),
    ("completions", "every_n_steps", 0, "an integer >= 1"),
    ("completions", "max_rows", 0, "an integer >= 1"),
    ("progress_bar", "refresh_rate", -1, "an integer >= 0"),
    ("progress_bar", "log_every_n_steps", 0, "an integer >= 1 (or unset)"),
    ("hub", "upload_retries", 0, "an integer >= 1"),
    ("hub", "retry_backoff", -1.0, "a number >= 0.0"),
]


def entry(key: str):
    return next(e for e in RUN_CALLBACKS if e.key == key)


@pytest.mark.parametrize("group, knob, value, valid", OUT_OF_RANGE, ids=[f"{g}.{k}" for g, k, _, _ in OUT_OF_RANGE])
def test_a_value_out_of_range_names_the_console_option_and_the_range(group, knob, value, valid):
    with pytest.raises(ValueError) as refused:
        entry(group).build(**{knob: value})
    assert str(refused.value).startswith(f"--{group}.{knob} {value}: must be {valid}; it is "), str(refused.value)


def test_every_numeric_knob_of_a_run_callback_has_a_range_case():
    """A numeric knob added to a run callback needs its check (and a row above): otherwise its bad value reaches
    Lightning or the loop and fails there, if at all."""
    checked = {(g, k) for g, k, _, _ in OUT_OF_RANGE}
    numeric = set()
    for e in RUN_CALLBACKS:
        hints = typing.get_type_hints(e.cls.__init__) if e.cls.__init__ is not object.__init__ else {}
        params = inspect.signature(e.cls.__init__).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):  # RunCheckpoint: ModelCheckpoint's arguments
            hints = typing.get_type_hints(e.cls.__mro__[1].__init__)
        for name, hint in hints.items():
            kinds = set(typing.get_args(hint)) or {hint}
            if name not in e.skip and kinds & {int, float} and bool not in kinds:
                numeric.add((e.key, name))
    assert numeric == checked


@pytest.mark.slow
@pytest.mark.parametrize("option, value, expected", [
    ("--completions.every_n_steps", "0", "--completions.every_n_steps 0: must be an integer >= 1; it is the optimizer "
                                         "steps between two tables."),
    # Lightning's own check raised from inside Lightning: a traceback before
    ("--checkpoint.every_n_train_steps", "-1", "--checkpoint.every_n_train_steps -1: must be an integer >= 0 (or "
                                               "unset); it is the optimizer steps between two checkpoints (0: none by "
                                               "steps)."),
])
def test_the_console_refuses_it_in_one_line(repo, tmp_path, option, value, expected):
    proc = console_script.run(repo, "fit", "--config", "configs/grpo_quickstart.yaml", option, value,
                              "--trainer.logger.init_args.save_dir", str(tmp_path), timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("lightalign: error:")]
    assert errors[:1] == [f"lightalign: error: {expected}"], out[-4000:]
    assert "Traceback" not in out, out[-4000:]
