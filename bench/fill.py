"""The daemon's pipelines in a dalid run: how many, shared or not, and how full their runs were.

Every dalid trainer reads the daemon's status (``StatusReport.pipelines``, what ``dalid status
--json`` shows) as its timed window ends, while its job is still registered: a job's pipeline
leaves the daemon with the job, so the last trainer alone would not see the pipelines of jobs
that ended before it. :func:`merge_readings` puts the trainers' readings together, one entry per
pipeline; :func:`pipeline_figures` sums them into the figures of the run. Counters run from the
pipeline's build, warm-up included. Plain data in and out, tested without a daemon.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def merge_readings(readings: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per pipeline of the daemon, by id: its last reading (the one with the most
    runs, then the latest), with every job any reading saw it serve. Readings that failed
    (``{"error": ...}``) are left out."""
    latest: dict[int, tuple[tuple[int, int], dict[str, Any]]] = {}
    jobs: dict[int, set[int]] = {}
    for reading in readings:
        for pipeline in reading.get("pipelines") or ():
            number = pipeline["pipeline"]
            order = (pipeline["runs"], reading["t_ns"])
            if number not in latest or order > latest[number][0]:
                latest[number] = (order, pipeline)
            jobs.setdefault(number, set()).update(pipeline["jobs"])
    return [
        {**pipeline, "jobs": sorted(jobs[number])}
        for number, (_, pipeline) in sorted(latest.items())
    ]


def pipeline_figures(pipelines: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """A run's figures from its merged pipelines; None without any (nothing was read).

    ``mean_fill`` is the samples of all runs over what those runs could have held (their run
    sizes), so a pipeline counts by its runs; ``mixed_share`` the share of runs that held
    batches of two jobs or more.
    """
    if not pipelines:
        return None
    runs = sum(p["runs"] for p in pipelines)
    samples = sum(p["samples"] for p in pipelines)
    room = sum(p["runs"] * p["run_size"] for p in pipelines)
    mixed = sum(p["mixed_runs"] for p in pipelines)
    return {
        "pipelines": len(pipelines),
        "shared": sum(1 for p in pipelines if p["shared"]),
        "jobs_per_pipeline": max(len(p["jobs"]) for p in pipelines),
        "threads": sum(p["threads"] * p.get("instances", 1) for p in pipelines),
        # DALI instances of the shared pipelines (the most any had when read), and why.
        "instances": max(p.get("instances", 1) for p in pipelines),
        "instances_reasons": sorted(
            {p["instances_reason"] for p in pipelines if p.get("instances_reason")}
        ),
        "run_size": max(p["run_size"] for p in pipelines),
        "runs": runs,
        "samples": samples,
        "mixed_runs": mixed,
        "mean_fill": samples / room if room else None,
        "mixed_share": mixed / runs if runs else None,
    }


def run_pipelines(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """From the trainers' results of one run: the merged pipelines, their figures (None when
    no trainer read any), and the errors of readings that failed."""
    readings = [result["pipelines"] for result in results if "pipelines" in result]
    merged = merge_readings(readings)
    return {
        "pipelines": merged,
        "figures": pipeline_figures(merged),
        "errors": [reading["error"] for reading in readings if "error" in reading],
        "batches_copied": batches_copied(readings),
    }


def batches_copied(readings: Sequence[dict[str, Any]]) -> int | None:
    """The batches the run's jobs got as private copies (Note [Private copies] in the daemon's
    copies.py), each job's count from the last reading that names it; None without one."""
    by_job: dict[int, int] = {}
    for reading in readings:
        for job in reading.get("jobs", ()):
            if "batches_copied" in job:
                by_job[job["job_id"]] = max(by_job.get(job["job_id"], 0), job["batches_copied"])
    return sum(by_job.values()) if by_job else None
