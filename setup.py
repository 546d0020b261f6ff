"""setuptools' entry beside pyproject.toml: the package list is discovered from the folders, so a new package
folder (one with ``__init__.py``) is in the wheel without anyone remembering to list it. Everything else about the
distribution lives in pyproject.toml.

The repository root is the package ``lightalign`` (``package-dir``), so each folder found here is a subpackage
``lightalign.<folder>``. tests/, bench/ and build outputs are not part of the package.
"""

from setuptools import find_packages, setup

NOT_SHIPPED = ["tests", "tests.*", "bench", "bench.*", "build", "build.*", "dist", "dist.*", "runs", "runs.*"]

setup(packages=["lightalign"] + [f"lightalign.{name}" for name in find_packages(where=".", exclude=NOT_SHIPPED)])
