"""What the installed package ships beside its code, and ``lightalign examples DIR`` that copies it out.

A wheel holds the YAML configs (``configs/``), the tiny tokenizer and model configs (``assets/``) and the example
data and scripts (``examples/``) inside the package. The shipped configs name those files by paths relative to the
working directory (``assets/models/tiny``, ``examples/data/arithmetic_sft.jsonl``) and the tool configs import
``examples.agent.calculator`` from it, so a user who installed the wheel copies them into a folder of their own and
runs the README's commands from there: ``lightalign examples lightalign-examples && cd lightalign-examples &&
lightalign fit --config configs/quickstart.yaml``. From a checkout the repository root is that folder already.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Sequence

PACKAGE_DIR = Path(__file__).resolve().parent
#: The folders the shipped configs read from the working directory, and the files of each that are copied.
SHIPPED = {
    "configs": ("*.yaml", "strategies/*.yaml", "strategies/*.json"),
    "assets": ("README.md", "models/*/*"),
    "examples": ("*.py", "*.sh", "*.sbatch", "agent/*.py", "data/*", "data/vlm_images/*.png"),
}


class ExamplesError(ValueError):
    """The destination of ``lightalign examples`` cannot take the copy (it holds files of the same names)."""


def shipped_files(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """Every file ``lightalign examples`` copies, relative to the package folder (sorted)."""
    files = {path.relative_to(package_dir) for folder, patterns in SHIPPED.items() for pattern in patterns
             for path in (package_dir / folder).glob(pattern) if path.is_file()}
    return sorted(files)


def copy_examples(dest: Path, package_dir: Path = PACKAGE_DIR, overwrite: bool = False) -> list[Path]:
    """Copy the shipped configs, assets and examples into ``dest`` (created); return the files written. A file that
    exists in ``dest`` is refused before anything is copied, unless ``overwrite``."""
    files = shipped_files(package_dir)
    if not files:
        raise ExamplesError(f"No shipped configs or examples under {package_dir}: this installation of lightalign "
                            "lacks its package data. Reinstall it (pip install --force-reinstall lightalign).")
    dest = Path(dest)
    clashes = [f for f in files if (dest / f).exists()]
    if clashes and not overwrite:
        raise ExamplesError(f"{dest} already holds {len(clashes)} of the files to copy (first: {clashes[0]}). Choose "
                            "another folder, or pass --overwrite to replace them.")
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(package_dir / f, dest / f)
    return files


def main(args: Sequence[str] | None = None) -> int:
    """``lightalign examples [DIR] [--overwrite]``: 0 once the files are copied."""
    parser = argparse.ArgumentParser(
        prog="lightalign examples",
        description="Copy the shipped configs (configs/), tiny tokenizer and model configs (assets/) and example data "
                    "and scripts (examples/) into DIR, so the README's commands run from there.")
    parser.add_argument("dir", nargs="?", default="lightalign-examples", help="destination (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace files DIR already holds")
    ns = parser.parse_args(args)
    files = copy_examples(Path(ns.dir), overwrite=ns.overwrite)
    print(f"Copied {len(files)} files (configs/, assets/, examples/) into {ns.dir}. Run the quickstart from there:\n"
          f"  cd {ns.dir} && lightalign fit --config configs/quickstart.yaml")
    return 0
