"""``ProcessDiedError``: a process the run needs (the sampling process of asynchronous rollouts, another DDP rank)
died under it, said in one line: which process, its pid, how it ended (the signal's name or the exit code) and that
``--ckpt_path last`` continues the run from its last checkpoint.

Without it a user sees the error of whatever noticed the death first, with its traceback: a queue's ``EOFError`` or
``SamplerProcessError: ... exited (code -9)`` (a hundred lines or more), or gloo's ``Connection reset by peer`` on rank
0 (nothing saying which rank died). The death itself is rarely lightalign's to explain (the out-of-memory killer, a
``kill``, a node going down), but what to do next always is: the checkpoints are intact (written atomically), so the
same command with ``--ckpt_path last`` resumes.

It is a ``RunError`` so that ``lightalign.cli.is_user_error`` prints it as one ``lightalign: error:`` line
(``--debug`` keeps the traceback).
"""

from __future__ import annotations

import signal

from lightalign.runs import RunError

RESUME = "The checkpoints written so far are intact: the same command with --ckpt_path last continues the run."


class ProcessDiedError(RunError):
    """A process of the run died while the run needed it; the message names it and says how to resume."""


def how_it_ended(exitcode: int | None) -> str:
    """``killed by SIGKILL`` for a negative exit code (``multiprocessing``'s and ``subprocess``'s ``-signal``),
    ``exited with code N`` otherwise, ``ended (exit status unknown)`` for None."""
    if exitcode is None:
        return "ended (exit status unknown)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}" + (" (a kill from outside, or the out-of-memory killer)"
                                          if -exitcode == signal.SIGKILL else "")
    return f"exited with code {exitcode}"


def died(what: str, pid: int | None, exitcode: int | None, while_doing: str) -> str:
    """The one-line message: ``{what} (pid N) was killed by SIGKILL while {while_doing}. {RESUME}``. A process that
    exited with a code of its own (> 0) ended on an error it printed itself: the message points there instead of
    advising a resume that would meet the same error."""
    at = f" (pid {pid})" if pid is not None else ""
    if exitcode is not None and exitcode > 0:
        return f"{what}{at} {how_it_ended(exitcode)} while {while_doing}: its own error, printed above, ended the run."
    return f"{what}{at} {how_it_ended(exitcode)} while {while_doing}. {RESUME}"
