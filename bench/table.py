"""Numbers and names as the tables and plots of a report show them."""

from __future__ import annotations

import math
from typing import Any

NONE = "n/a"


def fmt(value: float | None, digits: int = 0) -> str:
    """``1,234`` (or ``n/a`` for a missing or NaN value)."""
    if value is None or math.isnan(value):
        return NONE
    return f"{value:,.{digits}f}"


def spread_text(s: dict[str, float] | None, digits: int = 0, scale: float = 1.0) -> str:
    """``median [min-max]``, or just the median when there was one value."""
    if not s or not s.get("n"):
        return NONE
    median = fmt(s["median"] * scale, digits)
    if s["n"] == 1:
        return median
    return f"{median} [{fmt(s['min'] * scale, digits)}-{fmt(s['max'] * scale, digits)}]"


def gpu_names(machine: dict[str, Any]) -> str:
    """The machine's GPUs and driver, or "no GPU"."""
    gpus = machine.get("gpus") or []
    if not gpus:
        return "no GPU"
    return ", ".join(f"{g.get('name')} (driver {g.get('driver_version')})" for g in gpus)
