"""The package users install is the package tested: the sdist and the wheel are built from a clean export of this
checkout (its tracked and new files, nothing git ignores), the wheel holds every package folder and every shipped
file, and installed into a fresh venv outside the repository (no editable install; its core dependencies only, at
the pinned versions: tests/helpers/installed_venv.py) it imports, trains every method two steps through the Python
API and runs the shipped configs through the console script (tests/workers/installed_package.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from helpers import console_script
from helpers.installed_venv import make_venv

REPO = Path(__file__).resolve().parents[2]
NOT_SHIPPED = ("tests", "bench", "build", "dist", "runs")


def clean_export(dest: Path) -> Path:
    """The checkout's tracked and untracked-but-not-ignored files, copied to ``dest`` (no venvs, runs, caches)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():  # a file deleted in the work tree but still tracked is not exported
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """``python -m build`` on a clean export: the sdist, then the wheel built from that sdist."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the clean export lists the files with git")
    base = tmp_path_factory.mktemp("dist")
    source = clean_export(base / "source")
    out = base / "out"
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(source)], check=True,
                   capture_output=True, text=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (wheel,), (sdist,) = out.glob("*.whl"), out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "source": source}


def package_folders(root: Path) -> list[str]:
    """Every folder of the checkout holding ``__init__.py`` outside tests/bench/build outputs, as a wheel path."""
    found = []
    for init in root.rglob("__init__.py"):
        parts = init.parent.relative_to(root).parts
        if parts and parts[0] in NOT_SHIPPED or any(p.startswith(".") for p in parts):
            continue
        found.append("/".join(("lightalign", *parts)))
    return sorted(found)


def test_wheel_holds_every_package_and_shipped_file(dists):
    names = set(zipfile.ZipFile(dists["wheel"]).namelist())
    source = dists["source"]
    missing = [f"{folder}/__init__.py" for folder in package_folders(source) if f"{folder}/__init__.py" not in names]
    assert not missing, f"package folders left out of the wheel: {missing}"
    modules = [p for p in source.rglob("*.py") if (p.parent / "__init__.py").is_file() and p != source / "setup.py"]
    expected = {"/".join(("lightalign", *p.relative_to(source).parts)) for p in modules
                if p.relative_to(source).parts[0] not in NOT_SHIPPED}
    assert expected - names == set(), f"modules left out of the wheel: {sorted(expected - names)[:10]}"
    from lightalign.shipped import shipped_files

    data = {"lightalign/" + f.as_posix() for f in shipped_files(source)}
    assert {"lightalign/configs/quickstart.yaml", "lightalign/assets/models/tiny/tokenizer.json",
            "lightalign/examples/data/arithmetic_sft.jsonl", "lightalign/examples/agent/calculator.py"} <= data
    assert data - names == set(), f"shipped files left out of the wheel: {sorted(data - names)[:10]}"
    assert not [n for n in names if n.startswith(("lightalign/tests/", "lightalign/bench/"))]
    assert "lightalign/setup.py" not in names  # the build script is not a module of the package


def test_sdist_holds_what_the_wheel_is_built_from(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {"pyproject.toml", "setup.py", "README.md", "modules/sampling/__init__.py",
            "configs/quickstart.yaml"} <= names


@pytest.mark.slow
@pytest.mark.multiprocess  # about fifteen processes: among the longest tests, collected first
def test_installed_wheel_imports_trains_and_runs_the_shipped_configs(dists, tmp_path):
    # the wheel + its core dependencies and the vision extra's (Pillow: the VLM configs), pinned versions
    python = make_venv(dists["wheel"], tmp_path / "venv", extras=("vision",))
    work = tmp_path / "work"
    work.mkdir()
    env = console_script.standard_env(OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    done = subprocess.run([str(python), str(REPO / "tests" / "workers" / "installed_package.py"),
                           str(work), str(REPO)], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=1500)
    out = done.stdout
    assert done.returncode == 0, out[-6000:]
    assert "ok: all" in out
