"""``KnobGroup``: a typed, frozen bundle of knobs owned by the component that reads them.

A knob has one definition (a field: name, type, default), one description (``knob(..., doc)``) and one validation
(the group's ``check``, run when the group is built, i.e. when the module is constructed, before any model loads).
Components and losses receive their group object; a method lists the groups it takes (``takes_knobs``).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar

_NO_DEFAULT = dataclasses.MISSING


def knob(default: Any = _NO_DEFAULT, doc: str = "", *, factory: Any = _NO_DEFAULT, saved: bool = True) -> Any:
    """A knob's field: its default (or ``factory`` for a mutable one) and its one description (what ``--model.help``
    and the knob tables show). ``saved=False``: a Python object (a built model, a callable) kept out of the
    checkpoint's hyperparameters."""
    if not doc:
        raise TypeError("every knob has a description: knob(default, 'what it does')")
    metadata = {"doc": doc, "saved": saved}
    if factory is not _NO_DEFAULT:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class KnobGroup:
    """Base of every knob group (subclass as ``@dataclasses.dataclass(frozen=True)``). ``group`` names it in
    ``module.knobs``; ``check`` is the group's validation, run once, at construction."""

    group: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse values this group cannot work with, naming the knob (``ValueError``)."""

    @classmethod
    def knob_fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def knob_types(cls) -> dict[str, Any]:
        """Each knob's type, resolved (the fields' annotations are strings under postponed evaluation)."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    @classmethod
    def knob_default(cls, name: str) -> Any:
        field = {f.name: f for f in dataclasses.fields(cls)}[name]
        if field.default_factory is not _NO_DEFAULT:  # type: ignore[misc]
            return field.default_factory()  # type: ignore[misc]
        return field.default

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> "KnobGroup":
        """The group from the values of its knobs in ``values`` (others ignored; missing ones take their default)."""
        return cls(**{name: values[name] for name in cls.knob_names() if name in values})

    def values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
