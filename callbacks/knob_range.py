"""``check_at_least``: the range check of a run callback's numeric knob, whose message names the console option.

Every callback of ``lightalign.trainer.RUN_CALLBACKS`` is offered on the console as the group ``--<key>.*``
(``--completions.every_n_steps``), and built from it when the run starts; a value out of range must be refused at
that construction, in one line the user can act on: which option (as typed on the console, the same name as the
``checkpoint={...}`` keys of ``lightalign.Trainer``), the value given and the valid range. A message naming only the
bare argument (``every_n_steps and max_rows must be >= 1``) leaves a user who set several groups guessing, and
Lightning's own checks (``ModelCheckpoint``'s ``MisconfigurationException``) printed a traceback instead.

The error is a ``ValueError`` raised here, inside lightalign, so the console script prints it as its one-line
``lightalign: error:`` (``lightalign.cli.is_user_error``).
"""

from __future__ import annotations


def check_at_least(group: str, knob: str, value: float | None, minimum: float, meaning: str,
                   optional: bool = False) -> None:
    """Raise ``ValueError`` naming ``--<group>.<knob>`` when ``value`` is below ``minimum`` (None passes when
    ``optional``). ``meaning`` says what the knob does, so the message also says what a valid value means."""
    if value is None and optional:
        return
    if value is not None and not isinstance(value, bool) and value >= minimum:
        return
    kind = "an integer" if isinstance(minimum, int) else "a number"
    unset = " (or unset)" if optional else ""
    raise ValueError(f"--{group}.{knob} {value}: must be {kind} >= {minimum}{unset}; it is {meaning}.")
