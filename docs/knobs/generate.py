"""Write docs/knobs/<method>.md: one table per method class of every knob ``lightalign fit --model.help`` lists.

    python docs/knobs/generate.py           # (re)write the tables
    python docs/knobs/generate.py --check   # write nothing; exit 1 naming every stale, missing or extra file

A knob has one definition, one description and one validation: a field of one knob group (``lightalign.knobs``),
checked by the group's ``check``; a method's constructor signature and ``Args:`` are generated from its groups. The
tables are read from the same place the CLI reads them: a ``jsonargparse.ArgumentParser`` with
``add_class_arguments(cls, "model")``, one section per group. No knob name is written here: a knob added, renamed or removed
in a class shows up in its table at the next run (``tests/cli/test_knob_docs.py`` fails until then).
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

import jsonargparse

HERE = Path(__file__).resolve().parent  # docs/knobs
REPO = HERE.parent.parent
COMMAND = "python docs/knobs/generate.py"

# The method classes, in the order of the README. Each gets docs/knobs/<name without "Module", lower case>.md.
CLASSES = ("SFTModule", "DPOModule", "KTOModule", "RewardModule", "GRPOModule", "RLOOModule", "PPOModule",
           "DistillModule", "OnlineDPOModule", "CPOModule", "ORPOModule", "TPOModule", "GOLDModule",
           "SDFTModule", "SDPOModule", "A2POModule")

# As the CLI's parser (cli.py, LightalignCLI.add_core_arguments_to_parser): the modules' `model` argument, a built
# torch.nn.Module for the Python API, is not offered on the command line, so `--model.help` does not list it.
CLI_SKIP = {"model", "teacher_model"}

MISSING = "—"
CODE = re.compile(r"``([^`]+?)``")


def _import_lightalign():
    import lightalign

    package = Path(lightalign.__file__).resolve().parent
    if package != REPO:
        sys.exit(f"{COMMAND}: `import lightalign` gives {package}, not this checkout ({REPO}); "
                 f"run it with this checkout's environment (pip install -e {REPO}).")
    return lightalign


def file_name(cls_name: str) -> str:
    return cls_name.removesuffix("Module").lower() + ".md"


def _cell(text: str) -> str:
    """One table cell: RST ``code`` as markdown `code`, one line, `|` escaped."""
    text = " ".join(text.split())
    text = CODE.sub(r"`\1`", text)
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`" if text else ""


def _declared_by(cls, name: str) -> str:
    """The knob group that defines the knob (``lightalign.knobs``); for a class that still declares a parameter in
    its own ``__init__``, the first class in its MRO that names it."""
    from lightalign.knobs import method_knobs

    top = name.split(".", 1)[0]
    group = method_knobs(cls).get(top)
    if group is not None:
        return f"{group.__module__}.{group.__qualname__}"
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and top in inspect.signature(init).parameters:
            return klass.__name__
    return cls.__name__


def knobs(cls) -> tuple[str, list[dict]]:
    """The class's one-line summary and its knobs, in the order and with the texts of ``--model.help``."""
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(cls, "model", skip=CLI_SKIP)
    formatter = jsonargparse.DefaultHelpFormatter(prog="lightalign")
    rows = []
    for action in parser._actions:
        suppressed = isinstance(action.default, str) and action.default == argparse.SUPPRESS
        if suppressed or not action.dest.startswith("model."):
            continue  # --help, the group's config loader and the `.help` actions of class-typed knobs
        name = action.dest[len("model."):]
        default = "null" if action.default is None else str(action.default)  # as the help's "default: ..."
        rows.append({"name": name, "type": formatter._get_type_str(action) or "", "default": default,
                     "help": action.help or "", "declared_by": _declared_by(cls, name)})
    title = parser.groups["model"].title if "model" in parser.groups else ""
    return title or "", rows


def render(cls, undocumented: list[str] | None = None) -> str:
    title, rows = knobs(cls)
    if undocumented is not None:
        undocumented += [f"{cls.__name__}.{r['name']}" for r in rows if not r["help"]]
    path = f"lightalign.{cls.__name__}"
    lines = [
        f"# `{cls.__name__}` knobs",
        "",
        f"> Generated from the knob groups of `{path}` by `docs/knobs/generate.py`: do not "
        f"edit by hand. Change the group, then run `{COMMAND}` (`tests/cli/test_knob_docs.py` fails until then).",
        "",
    ]
    if title:
        lines += [_cell(title).rstrip(":.") + ".", ""]
    lines += [
        f"Every knob `lightalign fit --model.help {path}` lists: `--model.<name>` on the command line, "
        f"`model.init_args.<name>` in YAML, a keyword argument in Python. The data knobs are the datamodule's "
        f"(`lightalign fit --data.help ...`); the Trainer's are Lightning's (`lightalign fit --help`).",
        "",
    ]
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["declared_by"], []).append(row)
    for owner, group in groups.items():
        heading = f"Knobs of `{owner}`"
        if "." in owner:  # a knob group: its class, where it is defined and checked
            heading = f"`{owner.rsplit('.', 1)[1]}` (`{owner.rsplit('.', 1)[0]}`)"
        elif owner != cls.__name__:
            heading = f"Knobs from `{owner}` (passed through `**kwargs`)"
        lines += [f"## {heading}", "", "| knob | type | default | description |", "|---|---|---|---|"]
        lines += [f"| `{r['name']}` | {_code(r['type'])} | {_code(r['default'])} | {_cell(r['help']) or MISSING} |"
                  for r in group]
        lines.append("")
    if any(not r["help"] for r in rows):
        lines += [f"{MISSING}: no description `--model.help` can read. A class docstring's `Args:` needs one entry "
                  "per knob (`name: text`); an entry naming several knobs at once (`a, b: text`) describes none of "
                  "them.", ""]
    return "\n".join(lines)


def generate(undocumented: list[str] | None = None) -> dict[Path, str]:
    """Each table's path and text; ``undocumented`` collects the knobs whose docstring gives no description."""
    lightalign = _import_lightalign()
    return {HERE / file_name(name): render(getattr(lightalign, name), undocumented) for name in CLASSES}


def stale(files: dict[Path, str]) -> list[str]:
    """What differs from the generator's output: a file that is out of date, missing, or not generated at all."""
    problems = []
    for path, text in files.items():
        if not path.exists():
            problems.append(f"{path.relative_to(REPO)}: missing")
        elif (old := path.read_text(encoding="utf-8")) != text:
            old_lines, new_lines = old.splitlines(), text.splitlines()
            line = next((i for i, (a, b) in enumerate(zip(old_lines, new_lines), 1) if a != b),
                        min(len(old_lines), len(new_lines)) + 1)
            problems.append(f"{path.relative_to(REPO)}: out of date (differs from what the class docstrings give "
                            f"from line {line})")
    for path in sorted(HERE.glob("*.md")):
        if path not in files:
            problems.append(f"{path.relative_to(REPO)}: not produced by the generator (delete it)")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is stale")
    args = parser.parse_args(argv)
    undocumented: list[str] = []
    files = generate(undocumented)
    if args.check:
        problems = stale(files)
        if problems:
            print("stale knob tables:\n  " + "\n  ".join(problems) + f"\nregenerate them with: {COMMAND}")
            return 1
        print(f"{len(files)} knob tables up to date")
        return 0
    for path, text in files.items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(REPO)}")
    if undocumented:
        by_class: dict[str, list[str]] = {}
        for knob in undocumented:
            owner, name = knob.split(".", 1)
            by_class.setdefault(owner, []).append(name)
        print(f"{len(undocumented)} knobs have no description `--model.help` can read (shown as {MISSING}):\n  "
              + "\n  ".join(f"{owner}: {', '.join(names)}" for owner, names in by_class.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
