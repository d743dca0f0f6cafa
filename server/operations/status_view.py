"""``dalid status``: the daemon's status report as a table, or as JSON for scripts."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from dataclasses import dataclass
from typing import Any

from dalid.protocol import JobStatus, StatusReport


def as_json(report: StatusReport, extra: dict[str, Any] | None = None) -> str:
    """The report as one JSON object; jobs as a list of objects with the protocol's names.
    ``extra``: more keys (what the supervisor says of the daemon)."""
    return json.dumps({**dataclasses.asdict(report), **(extra or {})}, indent=2, sort_keys=True)


def size(nbytes: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f}{unit}"
    return f"{int(nbytes)}B"


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def headline(report: StatusReport, where: str) -> tuple[str, str]:
    """Two lines: which daemon, and how much of it is in use."""
    limit = size(report.memory_limit) if report.memory_limit else "no limit"
    return (
        f"dalid {report.device} daemon pid {report.daemon_pid} on {where}",
        f"up {_duration(report.uptime_seconds)}, DALI {report.dali_version}, "
        f"{len(report.jobs)}/{report.max_jobs} jobs, {report.concurrency} batches at once, "
        f"output memory {size(report.memory_reserved)} of {limit}",
    )


@dataclass(frozen=True)
class Column:
    """A column of the jobs table. Where the terminal is too narrow for all, those of the
    highest ``drop_order`` go first (0: never)."""

    header: str
    justify: str
    drop_order: int
    meaning: str


COLUMNS: tuple[Column, ...] = (
    Column("job", "right", 0, "the job's id on this daemon"),
    Column("name", "left", 0, "the name it gave at connect (name=...); - if none"),
    Column("pid", "right", 4, "the trainer's process id"),
    Column("weight", "right", 7, "its share of the daemon when jobs compete"),
    Column(
        "workers", "right", 10, "DataLoader workers its trainer started (N joined: those connected)"
    ),
    Column("pipes", "right", 11, "pipelines it registered"),
    Column("batches/s", "right", 9, "batches delivered a second, over the last 5 s"),
    Column("samples/s", "right", 0, "samples delivered a second, over the last 5 s"),
    Column("queue", "right", 3, "batches waiting to run (+ held back past its limit)"),
    Column("run", "right", 8, "batches running now"),
    Column("busy", "right", 6, "time the daemon spent running its batches"),
    Column("slot wait", "right", 5, "time its batches waited while other jobs' ran"),
    Column("data wait", "right", 2, "time the trainer waited for batches"),
    Column("held", "right", 1, "output buffers/bytes the trainer holds now"),
    Column("memory", "right", 3, "output memory reserved for the job"),
    Column("copies", "right", 5, "batches sent as private copies, its memory full (N dev: on GPU)"),
    Column("outputs", "left", 12, "shm (shared memory), cuda ipc or staged (GPU via shm)"),
)

# Rich's table with padding (0, 1) and no edge padding: two spaces between columns.
GAP = 2
# A table too wide first cuts names (with an ellipsis) to NAME_CUT characters, then drops
# columns, then cuts names down to MIN_NAME.
NAME_CUT = 16
MIN_NAME = 8


def job_name(job: JobStatus) -> str:
    """The name a job gave, or ``-``: a client that gives none names its job ``pid N``, which
    the pid column shows already."""
    return "-" if job.name in ("", f"pid {job.pid}") else job.name


def job_row(job: JobStatus) -> tuple[str, ...]:
    """One table row, in the order of COLUMNS."""
    queue = f"{job.queued}" + (f" (+{job.waiting})" if job.waiting else "")
    return (
        str(job.job_id),
        job_name(job),
        str(job.pid),
        f"{job.weight:g}",
        _workers(job),
        str(job.pipelines),
        f"{job.batches_per_second:.1f}",
        f"{job.samples_per_second:.0f}",
        queue,
        str(job.running),
        f"{job.run_seconds:.1f}s",
        f"{job.slot_wait_seconds:.1f}s",
        f"{job.trainer_wait_seconds:.1f}s",
        f"{job.regions_held}/{size(job.bytes_held)}",
        size(job.memory_bytes),
        _copies(job),
        job.output_path.replace("_", " "),
    )


def _workers(job: JobStatus) -> str:
    """A job's DataLoader workers: those its trainer says it started, and where those connected
    differ, how many (``2 (0 joined)``); a trainer that does not say: those connected."""
    started = job.workers_started
    if started is None or started == job.workers:
        return str(job.workers)
    return f"{started} ({job.workers} joined)"


def _copies(job: JobStatus) -> str:
    """A job's private copies; where some stayed on the GPU, how many (``N (M dev)``)."""
    if job.batches_copied_on_device:
        return f"{job.batches_copied} ({job.batches_copied_on_device} dev)"
    return str(job.batches_copied)


def fit_columns(rows: list[tuple[str, ...]], width: int) -> tuple[list[int], int]:
    """The indices of the columns that fit in ``width`` characters, and the width the name
    column gets (it may be cut). Columns go in ``drop_order``, highest first."""
    widths = [
        max([len(column.header), *(len(row[index]) for row in rows)])
        for index, column in enumerate(COLUMNS)
    ]
    name = next(i for i, column in enumerate(COLUMNS) if column.header == "name")
    kept = list(range(len(COLUMNS)))

    def total() -> int:
        return sum(widths[i] for i in kept) + GAP * (len(kept) - 1)

    if total() > width:
        widths[name] = min(widths[name], NAME_CUT)
    for index in sorted(kept, key=lambda i: -COLUMNS[i].drop_order):
        if total() <= width or COLUMNS[index].drop_order == 0:
            break
        kept.remove(index)
    return kept, max(MIN_NAME, widths[name] - max(0, total() - width))


PIPELINE_LINE = (
    "Below the table, a line per DALI pipeline the daemon runs, numbered as its log numbers it: "
    "the jobs it serves (jobs that register the same pipeline share one), and, once two jobs "
    "or more share it, how many of its runs mixed batches of two jobs or more and how full its "
    "runs were; a pipeline that is not shared says why. Then on how many DALI instances it runs "
    "and why"
)


def _jobs(jobs: tuple[int, ...]) -> str:
    return f"job {jobs[0]}" if len(jobs) == 1 else f"jobs {','.join(str(job) for job in jobs)}"


def pipeline_lines(report: StatusReport, width: int = 200) -> list[str]:
    """A line per pipeline in the daemon: the jobs it runs for, and how full its runs are;
    wrapped at ``width`` characters (a narrow terminal keeps all of it)."""
    lines = []
    for pipeline in report.pipelines:
        if not pipeline.jobs:
            how = "no job uses it now"
        elif not pipeline.shared:
            how = (
                f"{_jobs(pipeline.jobs)} alone, not shared: "
                f"{pipeline.private_reason or 'sharing is off'}"
            )
        elif len(pipeline.jobs) == 1:
            # Alone, its runs are its own batches: how full they are tells nothing.
            how = f"{_jobs(pipeline.jobs)} alone for now (a job that registers it too shares it)"
        else:
            how = f"shared by {_jobs(pipeline.jobs)}"
            if pipeline.runs:
                how += (
                    f": {pipeline.mixed_runs} of {pipeline.runs} runs mixed their batches; runs "
                    f"of up to {pipeline.run_size} samples, {pipeline.mean_fill:.0%} full on "
                    "average"
                )
        if pipeline.threads_asked:
            how += f"; {pipeline.threads} DALI threads of the {pipeline.threads_asked} asked"
        if pipeline.instances_reason:
            how += f"; {pipeline.instances_reason}"
        elif pipeline.instances > 1:
            how += f"; {pipeline.instances} DALI instances"
        line = f"DALI pipeline {pipeline.pipeline} {pipeline.name or 'unnamed'}: {how}"
        lines += textwrap.wrap(line, width=max(width, 20), subsequent_indent="  ")
    return lines


COHORT_LINE = (
    "Then a line per cohort (jobs that registered the same pipeline under one cohort name, whose "
    "batches of the same inputs run once): its jobs, the batches that ran and those served from "
    "another member's run (hits), how many batches the leading member is ahead of the trailing "
    "one, the output memory held for trailing members, of the most it may hold, and on a GPU "
    "daemon the cohort's GPU memory, whose buffers every member maps"
)


def cohort_lines(report: StatusReport, width: int = 200) -> list[str]:
    """A line per cohort: its members, hit rate, lag and memory held for trailing members."""
    lines = []
    for cohort in report.cohorts:
        jobs = ",".join(str(job) for job in cohort.jobs) or "none"
        line = (
            f"cohort {cohort.name}: jobs {jobs}; {cohort.runs} batches ran, {cohort.hits} served "
            f"from another member's run ({cohort.hit_rate:.0%} hits); members {cohort.lag_batches} "
            f"batches apart; {cohort.held_bytes >> 20} MiB held for trailing members of "
            f"{cohort.window_bytes >> 20} MiB"
        )
        if cohort.dropped:
            line += f"; {cohort.dropped} outputs dropped unserved"
        if cohort.device_bytes:
            # Its GPU memory is bounded by --cohort-memory, twice what waits for trailing members.
            line += (
                f"; {size(cohort.device_bytes)} of GPU memory of at most "
                f"{size(2 * cohort.window_bytes)}, mapped by every member"
            )
        if cohort.copied:
            line += f"; {cohort.copied} runs copied to each member's own memory"
        if cohort.behind:
            behind = ",".join(str(job) for job in cohort.behind)
            line += f"; jobs {behind} past the window, served runs of their own behind the others'"
        if cohort.behind_runs:
            line += f"; {cohort.behind_runs} batches ran for members past the window"
        lines += textwrap.wrap(line, width=max(width, 20), subsequent_indent="  ")
    return lines


def table(report: StatusReport, where: str, width: int = 200) -> Any:
    """A rich renderable, at most ``width`` columns wide: the headline and a row per job."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    lines = [Text(line) for line in headline(report, where)]
    if not report.jobs:
        return Group(*lines, Text("no jobs connected"))
    rows = [job_row(job) for job in report.jobs]
    kept, name_width = fit_columns(rows, width)
    jobs = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 1))
    for index in kept:
        column = COLUMNS[index]
        jobs.add_column(
            column.header,
            justify=column.justify,  # type: ignore[arg-type]
            no_wrap=True,
            max_width=name_width if column.header == "name" else None,
            overflow="ellipsis",
        )
    for row in rows:
        jobs.add_row(*(row[index] for index in kept))
    hidden = [COLUMNS[index].header for index in range(len(COLUMNS)) if index not in kept]
    below = [Text(f"not shown: {', '.join(hidden)}")] if hidden else []
    below += [Text(line) for line in pipeline_lines(report, width)]
    below += [Text(line) for line in cohort_lines(report, width)]
    return Group(*lines, jobs, *below)


def legend(width: int = 80) -> str:
    """What each column means, as a table, then the pipeline and cohort lines, for
    ``dalid status --help`` (printed as it is, not wrapped again)."""
    wide = max(len(column.header) for column in COLUMNS) + 2
    rows = [f"  {column.header + ':':<{wide}}{column.meaning}" for column in COLUMNS]
    notes = [
        textwrap.fill(text + ".", width=width, initial_indent="", subsequent_indent="")
        for text in (PIPELINE_LINE, COHORT_LINE)
    ]
    return "\n".join(["Columns:", *rows, "", notes[0], "", notes[1]])
