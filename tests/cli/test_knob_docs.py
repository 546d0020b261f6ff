"""docs/knobs/*.md are what docs/knobs/generate.py produces from the method classes' docstrings now: a knob added,
renamed, removed, re-defaulted or re-described in a class fails here until the tables are regenerated."""

import importlib.util
from pathlib import Path

GENERATOR = Path(__file__).resolve().parents[2] / "docs" / "knobs" / "generate.py"


def load_generator():
    spec = importlib.util.spec_from_file_location("knob_docs_generate", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_knob_tables_are_generated_from_the_class_docstrings():
    generate = load_generator()
    files = generate.generate()
    assert len(files) == len(generate.CLASSES) and all(text.strip() for text in files.values())
    problems = generate.stale(files)
    assert not problems, ("docs/knobs is stale:\n  " + "\n  ".join(problems)
                          + f"\nregenerate with: {generate.COMMAND}  (from the repository root)")
