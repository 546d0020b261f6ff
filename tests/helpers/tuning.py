"""Tests that need another value of a device-tuned constant (modules/training/device_tuning.py) for one test."""

from __future__ import annotations

from dataclasses import replace


def set_tuned(monkeypatch, name: str, value) -> None:
    """The measured value of table entry ``name`` is ``value`` until the test ends (its device type unchanged)."""
    from lightalign.modules.training import device_tuning

    monkeypatch.setitem(device_tuning.TABLE, name, replace(device_tuning.TABLE[name], value=value))
