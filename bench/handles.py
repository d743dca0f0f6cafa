"""The slab handles a dalid run opened: each slab of a job's output pool is mapped once by its
trainer (for GPU outputs, one ``cudaIpcOpenMemHandle``), so the opens of a run should equal the
slabs its jobs' pools made, all of them in the warm-up epoch, none later.

Every dalid trainer counts what its session has opened by the end of each epoch
(``contenders.DalidEpochs``) and reads its job's slab count from the daemon's status as its
timed window ends (``trainer.py``). Plain data in and out, tested without a daemon.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any


def per_epoch(cumulative: Sequence[int]) -> list[int]:
    """Counts at the end of each epoch (cumulative) as each epoch's own."""
    return [b - a for a, b in itertools.pairwise([0, *cumulative])]


def job_handles(result: dict[str, Any], warmup_epochs: int) -> dict[str, Any] | None:
    """One trainer's figures: opens per epoch, in all and after the warm-up, batch events
    opened per epoch, and its job's slabs and their peak bytes (None where the daemon's status
    was not read)."""
    handles = result.get("handles")
    if not handles:
        return None
    opens = per_epoch(handles["slabs_opened"])
    jobs = (result.get("pipelines") or {}).get("jobs") or []
    mine = [job for job in jobs if job["job_id"] == handles["job_id"]]
    return {
        "opens_per_epoch": opens,
        "events_per_epoch": per_epoch(handles["events_opened"]),
        "opens": sum(opens),
        "timed_opens": sum(opens[warmup_epochs:]),
        "slabs": mine[0]["slabs"] if mine else None,
        "peak_slab_bytes": mine[0].get("peak_slab_bytes") if mine else None,
        "output_path": mine[0].get("output_path", "") if mine else "",
    }


def run_handles(results: Sequence[dict[str, Any]], warmup_epochs: int) -> dict[str, Any] | None:
    """A run's figures, its jobs' added up (per epoch too); None where no trainer counted."""
    jobs = [found for r in results if (found := job_handles(r, warmup_epochs)) is not None]
    if not jobs:
        return None
    slabs = [job["slabs"] for job in jobs]
    peaks = [job["peak_slab_bytes"] for job in jobs if job["peak_slab_bytes"] is not None]

    def summed(name: str) -> list[int]:
        return [sum(epoch) for epoch in zip(*(job[name] for job in jobs), strict=True)]

    return {
        "opens_per_epoch": summed("opens_per_epoch"),
        "events_per_epoch": summed("events_per_epoch"),
        "opens": sum(job["opens"] for job in jobs),
        "timed_opens": sum(job["timed_opens"] for job in jobs),
        "slabs": None if None in slabs else sum(s for s in slabs if s is not None),
        # The most bytes of slabs a job's pools held at once, the mean over the run's jobs.
        "peak_slab_bytes_per_job": sum(peaks) / len(peaks) if peaks else None,
        "output_paths": sorted({job["output_path"] for job in jobs if job["output_path"]}),
    }
