"""What the console script reports in one line instead of a usage dump or a traceback.

* Config and option errors (an unknown key, a value of the wrong type, also for a knob typed as a Union such as
  ``float | None``, YAML that does not parse, in a ``--config`` file or on the command line; a ``--config`` file
  that is not there): jsonargparse prints its ~100-line usage and a nested message that never names the YAML file.
  ``OneLineErrorParser`` raises ``OptionError`` instead, and ``OptionError.describe`` says where (the file and line
  of the key, or the option as typed), which key, what was wrong, and the close match of a misspelt name or file
  name (difflib). ``--help`` and ``--model.help X`` are untouched (they exit through argparse, not ``error``).
* Trainer settings Lightning refuses when it builds the Trainer (an unknown strategy, a GPU that is not there, FSDP
  on CPU): ``trainer_refusal`` turns Lightning's error into a ``RunError`` naming the settings.
* What would fail only once training starts: DeepSpeed on CPU, a logger folder that cannot be written
  (``check_trainer_can_run``, called before the data is read or the model loads).
"""

from __future__ import annotations

import difflib
import inspect
import re
from pathlib import Path
from typing import Any, Iterable

from lightning.pytorch.cli import LightningArgumentParser

from lightalign.runs import RunError


class OptionError(Exception):
    """A config file or command-line option the parser refused; ``describe(argv)`` is the one-line message."""

    def __init__(self, message: str, cause: BaseException | None, options: Iterable[str]) -> None:
        super().__init__(message)
        self.messages = [message] + _chain(cause)
        self.options = sorted(o for o in options if o.startswith("--"))

    def describe(self, argv: list[str]) -> str:
        text = "\n".join(self.messages)
        configs = config_files(argv)
        if re.search(r'Parser key "config":\s*File does not exist', text):  # jsonargparse repeats it three times
            return _missing_config(argv)
        if "Problems parsing config" in text:
            return _yaml_syntax(configs) or _one_line(self.messages[-1])
        section = _first(r'Parser key "(\w+)"', text)
        class_path = _first(r"Problem with given class_path '([\w.]+)'", text)
        leaf = _first(r"Option '(\w+)' is not accepted", text)
        if leaf is not None:
            owner = _import(class_path)
            known = init_parameters(owner) if owner is not None else []
            name = owner.__name__ if owner is not None else section
            where = _where(section, leaf, argv, configs)
            typed = where.startswith("--")  # on the command line, else `file, line N`
            line = f"{name} has no option {where}" if typed else f"{where}: {name} has no option '{leaf}'"
            match = difflib.get_close_matches(leaf, known, n=1)
            instead = getattr(owner, "knob_equivalents", {}).get(leaf)  # TRL's name for one of the method's knobs
            from lightalign.modules.training.policy import RENAMED_KNOBS

            renamed = RENAMED_KNOBS.get(leaf) if section == "model" else None  # TRL's former name of a knob
            on_data = section == "model" and not instead and leaf in data_options()  # TRL's config holds it
            if renamed:
                line += f"; it is TRL's former name of {f'--{section}.{renamed}' if typed else repr(renamed)}: use that"
            elif on_data:
                line += f"; it is an option of the data here: {'--data.' + leaf if typed else repr('data.' + leaf)}"
            elif instead:
                line += f"; its {f'--{section}.{instead}' if typed else repr(instead)} is the same idea"
            elif match:
                line += f"; did you mean {f'--{section}.{match[0]}' if typed else repr(match[0])}?"
            elif section == "model":
                from lightalign.modules.training.policy import methods_with_knob, taken_by

                others = [m for m in methods_with_knob(leaf) if m != name]
                if others:
                    line += f"; {taken_by(others)}."
            hint = f"`lightalign fit --{section}.help {class_path}` lists its options." if class_path else ""
            return line + ("\n" + hint if hint else "")
        # a knob typed as a Union (`lmbda: float | None`): jsonargparse lists each subtype's refusal. `model` itself
        # is one (PolicyModule | None), so the innermost Union is the knob's, if its refusals nest no other key.
        unions = list(re.finditer(r'Parser key "([\w.]+)":\s*Does not validate against any of the Union subtypes\s*'
                                  r'Subtypes: \[(.*)\]', text))
        if unions:
            key, subtypes = unions[-1].groups()
            errors, _, value = text[unions[-1].end():].partition("Given value: ")
            if "Parser key" not in errors and "class_path" not in errors:
                return _expects(section, key, union_phrase(subtypes), value.splitlines()[0], argv, configs)
        typed = re.search(r'Parser key "([\w.]+)":\s*Expected (?:a )?(.+?)\. Got value: (.*)', text)
        if typed is not None:
            key, expected, value = typed.groups()
            expected = re.sub(r"<class '([\w.]+)'>", r"\1", expected)
            choices = re.fullmatch(r"(?:typing\.)?Literal\[(.*)\]", expected)  # Literal['gkd', 'on_policy']
            if choices is not None:
                expected = f"one of {choices.group(1)}"
            return _expects(section, key, expected, value, argv, configs)
        refused = _first(r"does not accept option '([\w.]+)'", text)  # a key of a config file the parser lacks
        if refused is not None:
            where = _where(refused.split(".")[0] if "." in refused else None, refused.rpartition(".")[2], argv, configs)
            match = difflib.get_close_matches(f"--{refused}", self.options, n=1)
            return f"{where}: unknown key '{refused}'" + (f"; did you mean '{match[0][2:]}'?" if match else ".")
        unknown = re.search(r"unrecognized arguments: (.*)", text)
        if unknown is not None:
            given = unknown.group(1).split()
            option = next((a.split("=")[0] for a in given if a.startswith("--")), given[0] if given else "")
            match = difflib.get_close_matches(option, self.options, n=1)
            return f"unknown option {option}" + (f"; did you mean {match[0]}?" if match else ".")
        return _one_line(self.messages[-1] if section is None else text)


class OneLineErrorParser(LightningArgumentParser):
    """LightningCLI's parser, raising ``OptionError`` where it would print the usage and exit."""

    def error(self, message: str, ex: Exception | None = None):
        from jsonargparse._common import debug_mode_active

        if not self.exit_on_error or debug_mode_active():  # jsonargparse's own nested parsing, or its debug mode
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        raise OptionError(message, ex, getattr(parser, "_option_string_actions", {})) from ex


def config_files(argv: list[str]) -> list[Path]:
    """The ``--config``/``-c`` files of a command line, in order."""
    files = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            files.append(Path(argv[i + 1]))
        elif arg.startswith("--config="):
            files.append(Path(arg.split("=", 1)[1]))
    return [f for f in files if f.is_file()]


def data_options() -> set[str]:
    """The options of the shipped data modules (TRL's trainer configs hold them beside the method's knobs, so a TRL
    recipe gives ``max_length`` or ``max_prompt_length`` to the model section)."""
    import lightalign.datamodules as datamodules

    classes = [getattr(datamodules, name) for name in datamodules.__all__ if name.endswith("DataModule")]
    return {name for cls in classes if isinstance(cls, type) for name in init_parameters(cls)} - {
        "path", "tokenizer", "name", "split", "seed"}  # the seed of the run is seed_everything, not the data's


def init_parameters(cls: type) -> list[str]:
    """The keyword arguments ``cls(...)`` accepts, following ``**kwargs`` up the class hierarchy."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names += [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return list(dict.fromkeys(names))


def _expects(section: str | None, key: str, expected: str, value: str, argv: list[str], configs: list[Path]) -> str:
    """``--model.lmbda expects <expected>, got 'half'.`` (typed), or ``file, line N: 'model.lmbda' expects ...``."""
    full = key if section is None or key == section or key.startswith(section + ".") else f"{section}.{key}"
    head, _, leaf = full.rpartition(".")
    where = _where(head or None, leaf, argv, configs)
    what = f"{where} expects" if where.startswith("--") else f"{where}: '{full}' expects"
    return f"{what} {expected}, got {value.strip()!r}."


# how a Union's subtype reads in a refusal ("a float or null"); other classes read "a <ClassName>"
_TYPE_PHRASES = {"float": "a float", "int": "an int", "str": "a string", "bool": "true or false", "NoneType": "null",
                 "dict": "a mapping", "list": "a list", "tuple": "a list"}


def union_phrase(subtypes: str) -> str:
    """jsonargparse's ``[<class 'float'>, list[float]]`` (a Union's subtypes) as ``a float or a list of floats``."""
    phrases = list(dict.fromkeys(_type_phrase(t) for t in _split_top_level(subtypes)))
    return phrases[0] if len(phrases) == 1 else f"{', '.join(phrases[:-1])} or {phrases[-1]}"


def _type_phrase(subtype: str) -> str:
    subtype = re.sub(r"<class '([\w.]+)'>", r"\1", subtype.strip()).removeprefix("typing.")
    choices = re.fullmatch(r"Literal\[(.*)\]", subtype)
    if choices is not None:
        return f"one of {choices.group(1)}"
    generic = re.fullmatch(r"(?:list|List|tuple|Tuple|Sequence|set|Set)\[(.*)\]", subtype)
    if generic is not None:
        items = _split_top_level(generic.group(1))
        simple = (len(items) == 1 or items[1:] == ["..."]) and not re.search(r"[|\[]", items[0])
        item = _type_phrase(items[0]) if simple else ""  # list[float] -> a list of floats; list[str | X] -> a list
        plural = re.fullmatch(r"an? (\w+)", item)
        return f"a list of {plural.group(1)}s" if plural else "a list"
    if re.fullmatch(r"(?:dict|Dict|Mapping)\[.*\]", subtype):
        return "a mapping"
    name = subtype.rpartition(".")[2]
    return _TYPE_PHRASES.get(name, f"a {name}")


def _split_top_level(text: str) -> list[str]:
    """``a, b[c, d], e`` -> ``['a', 'b[c, d]', 'e']`` (commas inside brackets kept)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += 1 if char in "[(" else -1 if char in "])" else 0
        if char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _missing_config(argv: list[str]) -> str:
    """``config file 'x.yaml' does not exist`` for the first ``--config`` file of ``argv`` that is not there, with
    the close name of a file in its folder (difflib), as typed."""
    given = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    given += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    missing = next((g for g in given if not Path(g).is_file()), None)
    if missing is None:
        return "a --config file does not exist."
    path = Path(missing)
    folder = path.parent
    names = sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
    match = difflib.get_close_matches(path.name, names, n=1)
    line = f"config file '{missing}' does not exist" + ("" if folder.is_dir() else f" (no folder '{folder}')")
    return line + (f"; did you mean {folder / match[0] if str(folder) != '.' else match[0]}?" if match else ".")


def _where(section: str | None, leaf: str, argv: list[str], configs: list[Path]) -> str:
    """The option as typed (``--model.learning_rat``), or ``file, line N`` of the key in the last config file that
    sets it."""
    prefixes = [f"--{section}.{leaf}", f"--{section}.init_args.{leaf}"] if section else [f"--{leaf}"]
    for arg in argv:
        if arg.split("=", 1)[0] in prefixes:
            return arg.split("=", 1)[0]
    for path in reversed(configs):
        line = yaml_key_line(path, section, leaf)
        if line is not None:
            return f"{path}, line {line}"
    return f"--{section}.{leaf}" if section else f"--{leaf}"


def yaml_key_line(path: Path, section: str | None, leaf: str) -> int | None:
    """The line (from 1) of key ``leaf`` under top-level key ``section`` in a YAML file (None: not there)."""
    import yaml

    try:
        root = yaml.compose(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return None
    found: list[int] = []

    def walk(node: Any, keys: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                here = keys + (str(key.value),)
                if here[-1] == leaf and (section is None or (len(here) > 1 and here[0] == section)):
                    found.append(key.start_mark.line + 1)
                walk(value, here)

    walk(root, ())
    return found[-1] if found else None


def _yaml_syntax(configs: list[Path]) -> str | None:
    """``file, line L, column C: invalid YAML (...)`` for the first config file that does not parse."""
    import yaml

    for path in configs:
        try:
            yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            context = getattr(err, "context", None)
            return f"{path}{at}: invalid YAML ({problem}{'; ' + context if context else ''})."
    return None


def _chain(err: BaseException | None) -> list[str]:
    out, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        out.append(str(err))
        err = err.__cause__
    return out


def _first(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text)
    return match.group(1) if match else None


def _import(class_path: str | None) -> type | None:
    if not class_path or "." not in class_path:
        return None
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(
        ("Given value", "Subtypes:", "- Expected a <class 'NoneType'>"))]
    line = " ".join(lines)
    return line if len(line) <= 400 else line[:397] + "..."


# --------------------------------------------------------------------------------------------- trainer
def trainer_refusal(err: BaseException, config: dict[str, Any]) -> RunError | None:
    """Lightning's refusal of the Trainer's settings as a ``RunError`` naming them (None: not such a refusal)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    if not isinstance(err, (ValueError, MisconfigurationException)) or not _raised_in(err, "lightning."):
        return None
    why = str(err).strip()
    named = [k for k in config if re.search(rf"\b{re.escape(k)}\b", why)]  # the settings the refusal is about
    given = [f"--trainer.{k} {config[k]}" for k in (named or ("accelerator", "strategy", "devices", "precision"))
             if isinstance(config.get(k), (str, int)) and config.get(k) not in ("auto",)]
    if "No supported gpu backend" in why:
        why = "no GPU is visible here (torch.cuda.is_available() is False). Use --trainer.accelerator cpu"
    return RunError(f"Lightning refused the trainer settings ({', '.join(given) or 'see --trainer.*'}): {why}")


def check_trainer_can_run(trainer: Any) -> None:
    """Refuse, before the data is read or the model loads, what would fail only once training starts."""
    from lightning.pytorch.accelerators import CUDAAccelerator
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(trainer.strategy, DeepSpeedStrategy) and not isinstance(trainer.accelerator, CUDAAccelerator):
        raise RunError(f"--trainer.strategy asks for DeepSpeed, which runs on CUDA GPUs only, and the accelerator here "
                       f"is {type(trainer.accelerator).__name__}. Use --trainer.strategy auto (or ddp) on CPU.")
    for logger in trainer.loggers:
        save_dir = getattr(logger, "save_dir", None) or getattr(logger, "root_dir", None)
        if save_dir is None or trainer.global_rank != 0:
            continue
        folder = Path(save_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".lightalign-write-probe-{id(trainer)}"
            probe.touch()
            probe.unlink()
        except OSError as err:
            raise RunError(f"The logger's folder '{save_dir}' cannot be written ({err.strerror or err}): a run writes "
                           "its metrics, config and checkpoints there. Choose another folder with "
                           "--trainer.logger.init_args.save_dir.") from err


def _raised_in(err: BaseException, prefix: str) -> bool:
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_globals.get("__name__", "").startswith(prefix)
