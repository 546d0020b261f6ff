"""Knobs in typed groups owned by the components that read them (``KnobGroup``), and the flat constructor signature
a method's groups give it (``takes_knobs``)."""

from lightalign.knobs.group import KnobGroup, knob
from lightalign.knobs.signature import KnobSet, method_knobs, takes_knobs

__all__ = ["KnobGroup", "KnobSet", "knob", "method_knobs", "takes_knobs"]
