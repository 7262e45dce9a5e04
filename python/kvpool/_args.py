"""Argument checks shared by the pure-Python modules (R29: a bool is no count)."""

from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, *, low: int) -> None:
    """An int (a bool is none: TypeError naming ``name``), at least ``low`` (ValueError)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value!r}")
