"""``dalid status``: the daemon's status report as a table, or as JSON for scripts."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from dalid.protocol import JobStatus, StatusReport


def as_json(report: StatusReport) -> str:
    """The report as one JSON object; jobs as a list of objects with the protocol's names."""
    return json.dumps(dataclasses.asdict(report), indent=2, sort_keys=True)


def size(nbytes: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f}{unit}"
    return f"{int(nbytes)}B"


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def headline(report: StatusReport, where: str) -> str:
    limit = size(report.memory_limit) if report.memory_limit else "no limit"
    return (
        f"dalid {report.device} daemon pid {report.daemon_pid} on {where} - up "
        f"{_duration(report.uptime_seconds)}, DALI {report.dali_version}, "
        f"{len(report.jobs)}/{report.max_jobs} jobs, {report.concurrency} batches at once, "
        f"memory reserved {size(report.memory_reserved)} of {limit}"
    )


COLUMNS: tuple[tuple[str, str], ...] = (
    ("job", "right"),
    ("name", "left"),
    ("pid", "right"),
    ("weight", "right"),
    ("workers", "right"),
    ("pipelines", "right"),
    ("batches/s", "right"),
    ("samples/s", "right"),
    ("queue", "right"),
    ("running", "right"),
    ("run time", "right"),
    ("waited for slots", "right"),
    ("trainer waited", "right"),
    ("buffers held", "right"),
    ("memory", "right"),
    ("outputs", "left"),
)


def job_row(job: JobStatus) -> tuple[str, ...]:
    """One table row. ``queue``: batches queued for the pipeline, plus held back over the limit."""
    queue = f"{job.queued}" + (f" (+{job.waiting})" if job.waiting else "")
    return (
        str(job.job_id),
        job.name,
        str(job.pid),
        f"{job.weight:g}",
        str(job.workers),
        str(job.pipelines),
        f"{job.batches_per_second:.1f}",
        f"{job.samples_per_second:.0f}",
        queue,
        str(job.running),
        f"{job.run_seconds:.1f}s",
        f"{job.slot_wait_seconds:.1f}s",
        f"{job.trainer_wait_seconds:.1f}s",
        f"{job.regions_held} / {size(job.bytes_held)}",
        size(job.memory_bytes),
        job.output_path.replace("_", " "),
    )


def table(report: StatusReport, where: str) -> Any:
    """A rich renderable: the headline and one row per job."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    jobs = Table(box=None, header_style="bold")
    for name, justify in COLUMNS:
        jobs.add_column(name, justify=justify)  # type: ignore[arg-type]
    for job in report.jobs:
        jobs.add_row(*job_row(job))
    if not report.jobs:
        return Group(Text(headline(report, where)), Text("no jobs connected"))
    return Group(Text(headline(report, where)), jobs)
