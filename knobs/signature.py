"""A method's knobs: the union of the groups it takes, each knob name once, surfaced as one flat keyword signature.

``takes_knobs(*groups)`` on a class adds the groups to its parent's (less the parent's groups named in ``without``:
a method lists only the knobs it takes) and gives the class a constructor whose
signature lists every knob by its own name (TRL's names: ``num_generations``, ``beta``), typed and defaulted by its
group, with the groups' descriptions as the ``Args:`` of its docstring. LightningCLI (``--model.help``,
``model.init_args.<knob>``), the knob tables in docs and the Python API all read that one signature. The
constructor builds the groups (each checks its knobs once) and calls the module's ``build_from_knobs``.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any, Callable

from lightalign.knobs.group import KnobGroup

POSITIONAL = ("model_name_or_path",)  # the one knob also accepted positionally (first)


class KnobSet:
    """The groups a module was built with, by ``KnobGroup.group`` name (``module.knobs.sampling.top_p``)."""

    def __init__(self, groups: dict[str, KnobGroup]):
        self.__dict__.update(groups)

    def __iter__(self):
        return iter(self.__dict__.values())

    def __contains__(self, group: str) -> bool:
        """Whether the method takes the group named ``group`` (e.g. ``"neftune" in module.knobs``)."""
        return group in self.__dict__

    def __repr__(self) -> str:
        return f"KnobSet({', '.join(self.__dict__)})"


def method_knobs(cls: type) -> dict[str, type[KnobGroup]]:
    """Each knob of ``cls`` -> the group that defines it, in declaration order."""
    return {name: group for group in getattr(cls, "knob_groups", ()) for name in group.knob_names()}


def _check_unique(cls: type, groups: tuple[type[KnobGroup], ...]) -> None:
    seen: dict[str, type[KnobGroup]] = {}
    names: dict[str, type[KnobGroup]] = {}
    for group in groups:
        if not group.group:
            raise TypeError(f"{group.__name__} has no `group` name")
        if group.group in names and names[group.group] is not group:
            raise TypeError(f"{cls.__name__}: groups {names[group.group].__name__} and {group.__name__} are both "
                            f"named {group.group!r}")
        names[group.group] = group
        for name in group.knob_names():
            if name in seen:
                raise TypeError(f"{cls.__name__}: knob {name!r} is defined by both {seen[name].__name__} and "
                                f"{group.__name__}; a knob has one definition")
            seen[name] = group


def _signature(cls: type) -> inspect.Signature:
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for group in cls.knob_groups:
        types = group.knob_types()
        for name in group.knob_names():
            kind = (inspect.Parameter.POSITIONAL_OR_KEYWORD if name in POSITIONAL
                    else inspect.Parameter.KEYWORD_ONLY)
            default = cls.knob_defaults[name] if name in cls.knob_defaults else group.knob_default(name)
            params.append(inspect.Parameter(name, kind, default=default, annotation=types[name]))
    params.sort(key=lambda p: p.kind)  # positional first, as Python requires
    return inspect.Signature(params)


def _docstring(cls: type) -> str:
    lines = [f"Build {cls.__name__} from its knobs (groups: "
             f"{', '.join(g.__name__ for g in cls.knob_groups)}).", "", "Args:"]
    for group in cls.knob_groups:
        for field in group.knob_fields():
            text = " ".join(field.metadata["doc"].split())
            wrapped = textwrap.wrap(f"{field.name}: {text}", width=112)
            lines += ["    " + wrapped[0], *("        " + w for w in wrapped[1:])]
    return "\n".join(lines)


def takes_knobs(*groups: type[KnobGroup], without: tuple[type[KnobGroup], ...] = (),
                defaults: dict[str, Any] | None = None) -> Callable[[type], type]:
    """Class decorator: the class takes its parent's knob groups and ``groups`` (see the module docstring).
    ``without``: parent groups the method does not take (their knobs leave its signature, ``--model.help`` and the
    methods a refusal names as taking them; the shared code reading them checks ``"<group>" in self.knobs``); a group
    the parent does not have is refused, as is one both added and dropped.
    ``defaults``: the method's own defaults of knobs its groups define (TRL's per-method defaults, e.g. DPO's
    ``disable_dropout: True``), shown in its signature and ``--model.help``."""

    def decorate(cls: type) -> type:
        inherited = tuple(getattr(cls, "knob_groups", ()))
        absent = [g.__name__ for g in without if g not in inherited]
        if absent:
            raise TypeError(f"{cls.__name__}: without={absent}, which its parent's knob groups do not include")
        both = [g.__name__ for g in without if g in groups]
        if both:
            raise TypeError(f"{cls.__name__}: {both} both taken and dropped (without=)")
        dropped = {name for group in without for name in group.knob_names()}
        dropped_defaults = sorted(set(defaults or {}) & dropped)
        if dropped_defaults:
            raise TypeError(f"{cls.__name__}: defaults for {dropped_defaults}, knobs of groups it drops (without=)")
        all_groups = tuple(dict.fromkeys(g for g in (*inherited, *groups) if g not in without))
        _check_unique(cls, all_groups)
        cls.knob_groups = all_groups
        cls.own_knob_groups = tuple(groups)
        known = {name for group in all_groups for name in group.knob_names()}
        unknown = sorted(set(defaults or {}) - known)
        if unknown:
            raise TypeError(f"{cls.__name__}: defaults for {unknown}, which none of its knob groups defines")
        inherited_defaults = {k: v for k, v in getattr(cls, "knob_defaults", {}).items() if k in known}
        cls.knob_defaults = {**inherited_defaults, **(defaults or {})}
        signature = _signature(cls)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            refuse = getattr(type(self), "refuse_unknown_knobs", None)
            known = signature.parameters
            if refuse is not None:
                refuse({k: v for k, v in kwargs.items() if k not in known})
            given = dict(signature.bind(self, *args, **kwargs).arguments)  # the knobs given; groups default the rest
            given.pop("self")
            self.construct_from_knobs({**type(self).knob_defaults, **given})

        __init__.__signature__ = signature  # type: ignore[attr-defined]
        __init__.__annotations__ = {name: p.annotation for name, p in signature.parameters.items() if name != "self"}
        __init__.__doc__ = _docstring(cls)
        # the Args also on the class: a subclass's own __init__ (passing **kwargs on) is described from its bases
        cls.__doc__ = (cls.__doc__ or cls.__name__).rstrip() + "\n\n" + __init__.__doc__.split("\n\n", 1)[1]
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        __init__.__module__ = cls.__module__
        cls.__init__ = __init__
        return cls

    return decorate
