"""No import cycle among the library's modules, lazy imports included.

Every ``import`` and ``from ... import`` of every library file (the package: not tests/, bench/, examples/, assets/,
docs/) is an edge, wherever it stands: at the top, inside a function, under ``TYPE_CHECKING``. A cycle closed only
by an import inside a function still says that two ideas live in each other's files; this test names every strongly
connected component of the graph.

Edges are the imports as written: ``import a.b`` is an edge to ``a.b``; ``from a import b`` is an edge to ``a.b``
when that is a module, else to ``a`` (its ``__init__``). The parent packages an import executes on the way
(``a``'s ``__init__`` for ``import a.b``) are not edges, and neither are the names ``_lazy.lazy_attributes`` maps to
modules (resolved by ``importlib`` on first use, never at import time).

Mutation: ``from lightalign.modules.sampling.choice import default_backend`` inside ``samplers.get_sampler`` (choice
imports samplers) -> ``test_no_import_cycle`` fails naming the seven modules of that cycle and their edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "lightalign"
NOT_LIBRARY = {"tests", "bench", "examples", "assets", "docs", "build", "dist", "runs"}


def library_modules(root: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> file, for every library ``.py`` file (a package's ``__init__.py`` is the package)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in NOT_LIBRARY or any(p.startswith(".") for p in parts) or parts == ("setup.py",):
            continue
        names = [PACKAGE, *parts[:-1]] + ([] if parts[-1] == "__init__.py" else [parts[-1][:-3]])
        modules[".".join(names)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The library modules ``name`` (at ``path``) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, one level up per dot after the first
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    modules = library_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"    {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"  {len(component)} modules: {', '.join(component)}\n" + "\n".join(edges)


def test_graph_sees_lazy_and_relative_imports(tmp_path):
    """The walk finds an import inside a function and resolves ``from . import x`` and ``from .x import y``."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from lightalign.pkg.b import g\n    return g\n")
    (tmp_path / "pkg" / "b.py").write_text("from . import c\n")
    (tmp_path / "pkg" / "c.py").write_text("from .a import f\nimport os\n")
    graph = import_graph(tmp_path)
    assert graph["lightalign.pkg.a"] == {"lightalign.pkg.b"}
    assert graph["lightalign.pkg.b"] == {"lightalign.pkg.c"}
    assert graph["lightalign.pkg.c"] == {"lightalign.pkg.a"}
    assert cycles(graph) == [["lightalign.pkg.a", "lightalign.pkg.b", "lightalign.pkg.c"]]


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 100, f"only {len(graph)} library modules found under {REPO}"
    found = cycles(graph)
    assert not found, ("Import cycles (lazy imports included); move the code to where its idea lives:\n"
                       + "\n".join(describe(c, graph) for c in found))
