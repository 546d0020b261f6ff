"""Each knob is validated once: in its group's ``check``, at construction. A check of one knob's value anywhere else
(a loss function re-checking ``beta`` on every step, a buffer re-checking ``num_generations`` on every rollout) is
a second validation, with a second message that drifts from the first."""

from __future__ import annotations

import ast
from pathlib import Path

from test_knob_groups import all_groups

ROOT = Path(__file__).resolve().parents[2]
LIBRARY_SKIP = {"tests", "bench", "docs", "assets", "examples", "configs", "runs", "setup.py"}


def library_files() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] not in LIBRARY_SKIP
            and not any(part.startswith(".") or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)]


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
    todo = list(called)
    while todo:
        for name in functions.get(todo.pop(), ()):
            if name not in called:
                called.add(name)
                todo.append(name)
    return called


def raising_checks(tree: ast.AST, knob_names: set[str], allowed: set[str]):
    """``(line, knob)`` of each ``if`` whose body raises and whose test reads exactly one knob (by name or as an
    attribute), outside the knob groups' classes and the functions they call (``allowed``)."""
    def visit(node: ast.AST, in_group: bool):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            in_group = in_group or node.name in allowed
        if isinstance(node, ast.If) and not in_group and any(isinstance(b, ast.Raise) for b in node.body):
            read = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            read |= {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
            knobs = read & knob_names
            if len(knobs) == 1:
                yield node.lineno, knobs.pop()
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
