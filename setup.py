"""setuptools' entry beside pyproject.toml: the package list is discovered from the folders, so a new package
folder (one with ``__init__.py``) is in the wheel without anyone remembering to list it. Everything else about the
distribution lives in pyproject.toml.

The repository root is the package ``lightalign`` (``package-dir``), so each folder found here is a subpackage
``lightalign.<folder>``. tests/, bench/ and build outputs are not part of the package, and neither is this file
(the root package would otherwise ship it as the module ``lightalign.setup``).
"""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

NOT_SHIPPED = ["tests", "tests.*", "bench", "bench.*", "build", "build.*", "dist", "dist.*", "runs", "runs.*"]


class BuildWithoutSetupScript(build_py):
    """``build_py`` without the root package's ``setup`` module (this file)."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("lightalign", "setup")]


setup(packages=["lightalign"] + [f"lightalign.{name}" for name in find_packages(where=".", exclude=NOT_SHIPPED)],
      cmdclass={"build_py": BuildWithoutSetupScript})
