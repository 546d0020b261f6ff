"""Docstrings and comments of the library say what and why and name symbols (the design's conventions).

A date, a commit hash or a file path in a docstring goes stale: the date and the hash are history (docs/changelog.md),
and a path breaks when a file moves, while the symbol it meant (``DPOModule``, ``sample_completions``) moves with
the code. This walks every library module's docstrings (module, class, function: ``ast.get_docstring``) and comments
(``tokenize`` COMMENT tokens) and names each offending ``file:line``.

Allowed: ``__init__.py`` alone (a package's init file is a concept, not a location), dotted import paths
(``lightalign.rewards.accuracy_reward``: YAML names reward functions that way), paths of files that are not Python
(``docs/performance.md``, ``config.json``). Not tested: history words ("was", "no longer"), too fuzzy to test.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import lightalign

ROOT = Path(lightalign.__file__).resolve().parent
NOT_LIBRARY = {"tests", "bench", "docs", "assets", "examples", "build", "dist"}  # top-level folders that are no library

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# 7-40 lowercase hex characters with at least one digit and one letter: what ``git log --oneline`` prints
HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
# a Python file named by its name or path: ``dpo.py``, ``modules/dpo.py``, ``trl/trainer/ppo_trainer.py``
PY_PATH = re.compile(r"(?<![\w.])(?:[\w.-]+/)*[\w-]+\.py\b")
ALLOWED_PATHS = {"__init__.py"}


def library_files() -> list[Path]:
    files = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if parts[0] in NOT_LIBRARY or any(p.startswith(".") or p == "__pycache__" or p.endswith(".egg-info")
                                          or p == "site-packages" for p in parts):
            continue
        files.append(path)
    return files


def texts(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every docstring and comment of a module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if ast.get_docstring(node, clean=False) is not None:
                found.append((node.body[0].value.lineno, node.body[0].value.value))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


def findings(source: str) -> list[tuple[int, str, str]]:
    """(line, what, the text found) for each date, commit hash and Python file path in the docstrings and comments."""
    out = []
    for first, text in texts(source):
        for offset, line in enumerate(text.split("\n")):
            for what, pattern in (("date", DATE), ("commit hash", HASH), ("file path", PY_PATH)):
                for match in pattern.finditer(line):
                    if what == "file path" and match.group() in ALLOWED_PATHS:
                        continue
                    out.append((first + offset, what, match.group()))
    return sorted(out)


def test_the_checks_find_what_they_should_and_nothing_else():
    source = '''"""Module: see ``modules/dpo.py`` and dpo_loss.py (measured 2026-11-25 at commit 4f9e3ca).

Fine: ``lightalign.rewards.accuracy_reward``, a package's ``__init__.py``, docs/performance.md, config.json,
float32, deadbeef (no digit), 1234567 (no letter), 0x7fffffff, ``DPOModule``.
"""
x = 1  # the old bench/dpo.py figure of 2026-01-02


def f():
    """Calls ``trl/trainer/ppo_trainer.py``."""
'''
    assert findings(source) == [
        (1, "commit hash", "4f9e3ca"), (1, "date", "2026-11-25"),
        (1, "file path", "dpo_loss.py"), (1, "file path", "modules/dpo.py"),
        (6, "date", "2026-01-02"), (6, "file path", "bench/dpo.py"),
        (10, "file path", "trl/trainer/ppo_trainer.py"),
    ]


def test_library_files_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in library_files()}
    assert {"cli.py", "modules/dpo.py", "datamodules/preference.py"} <= names
    assert not any(n.split("/")[0] in NOT_LIBRARY for n in names)


def test_docstrings_and_comments_hold_no_dates_hashes_or_file_paths():
    problems = [f"{path.relative_to(ROOT).as_posix()}:{line}: {what} {text!r}"
                for path in library_files() for line, what, text in findings(path.read_text(encoding="utf-8"))]
    assert not problems, ("docstrings and comments name symbols, not file paths; dates, commit hashes and history "
                          "go to docs/changelog.md, measurements to docs/performance.md:\n" + "\n".join(problems))
