"""Medians with their spread, and quantiles: how the bench sums up repeated figures."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import numpy as np


def spread(values: Iterable[float]) -> dict[str, float]:
    """Median, min and max (and how many values)."""
    data = list(values)
    if not data:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {
        "median": statistics.median(data),
        "min": min(data),
        "max": max(data),
        "n": len(data),
    }


def quantiles(values: Sequence[float]) -> dict[str, float]:
    array = np.asarray(values, dtype=float)
    return {
        "p50": float(np.percentile(array, 50)),
        "p90": float(np.percentile(array, 90)),
        "p99": float(np.percentile(array, 99)),
        "mean": float(array.mean()),
        "min": float(array.min()),
        "max": float(array.max()),
        "n": len(array),
    }
