"""The weighted run: two jobs of weights 1 and 3 sharing one pipeline in the daemon.

Both jobs start together and keep the daemon busy. Between epochs a DataLoader drains (no
batch in flight until the next epoch's first ones), and while one job drains the other gets
the daemon's time. So an epoch of the lightest job goes over the images ``PASSES`` times, to
make fewer epoch ends, and an epoch of the heavier job as many times more as its weight is
heavier (``by_weight``), so that at their shares both jobs end their epochs together, neither
running out of work while the other still iterates. Its DataLoader workers keep as many
more batches in flight, so that it keeps batches queued in the daemon though they come back
three times as fast. Each job's samples/s is counted over the window in which both are past
their warm-up and neither has finished (the common window); the heavy job's rate over the
light job's should come to the ratio of their weights, 3. While the jobs run, the orchestrator
reads each job's queue in the daemon a few times a second: a job with no batch queued was
waiting on its own trainer and workers, not on the daemon, and its share says nothing about the
weights. The logic here is plain data in and out, so that it can be tested without running
anything.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

WEIGHTS = "weights"  # the --only key, and the contender, of the weighted run
JOB_WEIGHTS = (1.0, 3.0)  # the weights of its jobs, job 0 first
TOLERANCE = 0.10  # how far the heavy job's rate over the light job's may be from the weights'
QUEUE_INTERVAL_S = 0.25  # how often the orchestrator reads the jobs' queues
PREFETCH = 2  # batches in flight per DataLoader worker of the lightest job (torch's default)
PASSES = 2  # times an epoch of the lightest job goes over the images


def by_weight(count: int, weight: float, weights: Sequence[float]) -> int:
    """``count`` for the lightest of jobs of ``weights``, for a job of ``weight``: as many
    times more as its weight is heavier, rounded up."""
    lightest = min(weights)
    if lightest <= 0 or weight <= 0:
        raise ValueError(f"weights must be positive: {list(weights)}")
    return math.ceil(count * weight / lightest - 1e-9)


def weight_ratio(rates: Sequence[float], weights: Sequence[float]) -> dict[str, float] | None:
    """The heaviest job's samples/s over the lightest's, the ratio of their weights, and how
    far the first is from the second (``error``: ``ratio / expected - 1``); None when the
    weights are all equal or the lightest job got nothing (no ratio to take)."""
    if len(rates) != len(weights) or len(rates) < 2:
        raise ValueError(f"need a rate per weight, at least two: {rates}, {weights}")
    heavy = max(range(len(weights)), key=lambda job: weights[job])
    light = min(range(len(weights)), key=lambda job: weights[job])
    if weights[heavy] == weights[light] or rates[light] <= 0:
        return None
    ratio = rates[heavy] / rates[light]
    expected = weights[heavy] / weights[light]
    return {"ratio": ratio, "expected": expected, "error": ratio / expected - 1}


def within(error: float, tolerance: float = TOLERANCE) -> bool:
    """Whether a ratio ``error`` (``ratio / expected - 1``) is within ``tolerance``."""
    return abs(error) <= tolerance + 1e-12


def queue_figures(
    readings: Sequence[dict[str, Any]], job_ids: Sequence[int], start_ns: int, end_ns: int
) -> list[dict[str, float] | None]:
    """Per job of ``job_ids``, from the daemon's readings of its jobs taken in ``[start_ns,
    end_ns]``: the median of its queued batches (waiting for the pipeline), and the share of
    readings in which it had at least one queued (``backlogged``: 1 when the daemon, not the
    job, held it back all along). None for a job no reading in the window saw."""
    found: list[dict[str, float] | None] = []
    for job_id in job_ids:
        queued = [
            job["queued"]
            for reading in readings
            if start_ns <= reading["t_ns"] <= end_ns
            for job in reading.get("jobs") or ()
            if job["job_id"] == job_id
        ]
        if not queued:
            found.append(None)
            continue
        found.append(
            {
                "queued": statistics.median(queued),
                "backlogged": sum(1 for depth in queued if depth > 0) / len(queued),
                "readings": len(queued),
            }
        )
    return found
