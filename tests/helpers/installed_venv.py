"""A fresh venv holding a lightalign wheel and exactly its core dependencies, made in seconds and offline.

``pip install lightalign.whl`` into a new venv resolves every dependency against the package index: several minutes
here (one index round trip per package), most of a CI run's budget for one test. The packages it would install are
already in the test venv, at the pinned versions of constraints.txt. So the venv is assembled from them:

1. ``python -m venv`` (no packages but pip);
2. the wheel's ``Requires-Dist`` without extras, followed recursively through the test venv's installed
   distributions (``importlib.metadata``), gives the dependency closure; each distribution's top-level files (from
   its ``RECORD``) are linked into the new venv's site-packages. Nothing of the dev extras (peft, deepspeed, ...)
   is there, so a module that imports an undeclared dependency fails as it would for a user;
3. ``pip install --no-deps --no-index`` of the wheel itself (no editable install), then ``pip check``: every declared
   requirement and version is satisfied by what was linked.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def wheel_requirements(wheel: Path, extras: tuple[str, ...] = ()) -> list[Requirement]:
    """The wheel's ``Requires-Dist`` that apply on this interpreter without extras or with ``extras``."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(name).decode())
    return [r for r in map(Requirement, meta.get_all("Requires-Dist") or [])
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ("", *extras))]


def dependency_closure(requirements: list[Requirement]) -> list[metadata.Distribution]:
    """The installed distributions ``requirements`` need, transitively (markers evaluated, no extras)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        req = todo.pop()
        key = canonicalize_name(req.name)
        if key in seen:
            continue
        dist = metadata.distribution(req.name)  # raises PackageNotFoundError: the test venv lacks a declared dep
        if dist.version not in req.specifier:
            raise AssertionError(f"{req} is declared, the test venv has {dist.version}")
        seen[key] = dist
        for extra in req.extras:  # e.g. jsonargparse[signatures]
            todo += [r for r in map(Requirement, dist.requires or []) if r.marker is not None
                     and r.marker.evaluate({"extra": extra})]
        todo += [r for r in map(Requirement, dist.requires or []) if r.marker is None
                 or r.marker.evaluate({"extra": ""})]
    return list(seen.values())


def make_venv(wheel: Path, venv: Path, extras: tuple[str, ...] = ()) -> Path:
    """The venv (see the module docstring), with the dependencies of ``extras`` too; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for dist in dependency_closure(wheel_requirements(wheel, extras)) + [metadata.distribution("pip")]:
        root = Path(dist.locate_file(""))
        for top in sorted({Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}):
            if not (site / top).exists() and (root / top).exists():
                os.symlink(root / top, site / top)
    run = dict(capture_output=True, text=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    for args in (["install", "--no-deps", "--no-index", "-q", str(wheel)], ["check"]):
        done = subprocess.run([str(python), "-m", "pip", *args], **run)
        if done.returncode != 0:
            raise AssertionError(f"pip {' '.join(args)} in {venv}:\n{(done.stdout + done.stderr)[-4000:]}")
    return python
