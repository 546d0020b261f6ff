"""Each knob is validated once: in its group's ``check``, at construction. A check of one knob's value anywhere else
(a loss function re-checking ``beta`` on every step, a buffer re-checking ``num_generations`` on every rollout) is
a second validation, with a second message that drifts from the first."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

from test_knob_groups import all_groups

ROOT = Path(__file__).resolve().parents[2]
# datamodules validate their own knobs (``max_length``, ``pack_length`` ...), which are not the modules' knob groups
LIBRARY_SKIP = {"tests", "bench", "docs", "assets", "examples", "configs", "runs", "setup.py", "datamodules"}


def library_files() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] not in LIBRARY_SKIP
            and not any(part.startswith(".") or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)]


REGISTERED_CHECKS: set[str] = set()  # functions registered as a variant's check (``register_policy_loss(check=)``)


def calls_in(node: ast.AST) -> set[str]:
    return {call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
            for call in ast.walk(node) if isinstance(call, ast.Call)}


def called_by_groups(trees: list[ast.AST], group_classes: set[str]) -> set[str]:  # noqa: C901
    """Names of the functions the groups' classes call, directly or through each other (their ``check`` delegates
    to them: still one validation)."""
    functions: dict[str, set[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                functions.setdefault(node.name, set()).update(calls_in(node))
    called = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in group_classes:
                for call in ast.walk(node):
                    if isinstance(call, ast.Call):
                        func = call.func
                        called.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
            # a check registered with a variant (``register_policy_loss(..., check=fn)``) runs in the group's check
            if isinstance(node, ast.keyword) and node.arg == "check" and isinstance(node.value, ast.Name):
                called.add(node.value.id)
                REGISTERED_CHECKS.add(node.value.id)
    # through the check functions they call (``check_*``, ``_check_*``, ``validate_*``: validation is named so)
    called = {name for name in called if is_check(name)} | set(group_classes)
    todo = list(called)
    while todo:
        for name in functions.get(todo.pop(), ()):
            if name not in called and is_check(name):
                called.add(name)
                todo.append(name)
    return called


def is_check(name: str) -> bool:
    return name.lstrip("_").startswith(("check", "validate", "needs", "refuse")) or name in REGISTERED_CHECKS


def names_read(test: ast.AST) -> set[str]:
    """The variables and attributes a condition reads, without builtins, constants (UPPER_CASE), ``self`` and the
    methods it calls."""
    called = {id(node.func) for node in ast.walk(test) if isinstance(node, ast.Call)}
    read = set()
    for node in ast.walk(test):
        if isinstance(node, ast.Name) and id(node) not in called and node.id != "self" \
                and not node.id.isupper() and node.id not in dir(builtins):
            read.add(node.id)
        elif isinstance(node, ast.Attribute) and id(node) not in called and not node.attr.isupper():
            read.add(node.attr)
    return read


def only_none_test(test: ast.AST) -> bool:
    """``x is None`` / ``x is not None``: whether a value was given (what the code does without one), not a check
    of the value."""
    return isinstance(test, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in test.ops) \
        and all(isinstance(c, ast.Constant) and c.value is None for c in test.comparators)


def raising_checks(tree: ast.AST, knob_names: set[str], allowed: set[str]):
    """``(line, knob)`` of each ``if`` whose body raises and whose condition reads one knob's value and nothing else
    (a validation of that knob: a condition that also reads a tensor or another setting checks the inputs or a
    combination), outside the knob groups' checks and what they call (``allowed``)."""
    def visit(node: ast.AST, in_group: bool):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            in_group = in_group or node.name in allowed
        if isinstance(node, ast.If) and not in_group and any(isinstance(b, ast.Raise) for b in node.body):
            read = names_read(node.test)
            if len(read) == 1 and read <= knob_names and not only_none_test(node.test):
                yield node.lineno, next(iter(read))
        for child in ast.iter_child_nodes(node):
            yield from visit(child, in_group)
    yield from visit(tree, False)


def test_a_knob_is_validated_only_by_its_group():
    """Mutation: put ``if beta < 0: raise`` back into ``dpo_loss`` -> this test names modules/losses/dpo.py."""
    groups = all_groups()
    # value knobs (a Python object such as ``model`` or ``tools`` is resolved, not range-checked)
    knob_names = {f.name for group in groups for f in group.knob_fields() if f.metadata["saved"]}
    group_classes = {group.__name__ for group in groups}
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in library_files()}
    # the groups, the functions their checks call, and the methods' cross-group hook (each group checked its own)
    roots = group_classes | {"check_knob_combinations"}
    allowed = roots | called_by_groups(list(trees.values()), roots)
    found = []
    for path, tree in trees.items():
        found += [f"{path.relative_to(ROOT)}:{line} checks {knob}"
                  for line, knob in raising_checks(tree, knob_names, allowed)]
    assert not found, "knobs validated outside their group's check:\n" + "\n".join(found)
