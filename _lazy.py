"""Package attributes imported on first use (PEP 562): ``import lightalign`` (and the sampling process, which imports
one module of it) does not pull in every method, Lightning and datasets."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_attributes(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps each public name to the module defining it."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value  # imported once
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
