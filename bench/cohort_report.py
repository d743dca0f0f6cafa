"""The cohort section of a report: the cohort runs' throughput and memory (their hit rate is a
target), and where every run's PSS is, by role and kind of page (see :mod:`bench.memory`)."""

from __future__ import annotations

from typing import Any

from .contenders import CONTENDERS
from .memory import ROLES
from .scaling import COHORT_KINDS
from .summary import BASELINE
from .table import NONE, fmt, spread_text

_KIND_HEADS = (("anon_mb", "anonymous"), ("file_mb", "file-backed"), ("shmem_mb", "shared memory"))


def cohort_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of the cohort runs (``--only cohort``) that measured something, by job count;
    none when no cohort ran."""
    rows = [
        row
        for row in report["summary"]["rows"]
        if row["kind"] in COHORT_KINDS and row["samples_per_s"]["n"]
    ]
    if not any(row["kind"].startswith("dalid-cohort") for row in rows):
        return []
    counts = {row["jobs"] for row in rows if row["kind"].startswith("dalid-cohort")}
    rows = [row for row in rows if row["jobs"] in counts]
    return sorted(rows, key=lambda row: (row["jobs"], COHORT_KINDS.index(row["kind"])))


def _median(row: dict[str, Any], name: str) -> float | None:
    value = row["memory"].get(name, {})
    return value["median"] if value.get("n") else None


def _role_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per run and role that ran: processes, PSS and its split by kind of page."""
    lines = [
        "| jobs | contender | role | processes | PSS MiB | "
        + " | ".join(f"{head} MiB" for _, head in _KIND_HEADS)
        + " |",
        "|--:|---|---|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        for role in ROLES:
            processes = _median(row, f"role_{role}_processes")
            if not processes:
                continue
            cells = [fmt(_median(row, f"role_{role}_{name}")) for name, _ in _KIND_HEADS]
            lines.append(
                f"| {row['jobs']} | {CONTENDERS[row['kind']].label} | {role} | {fmt(processes)} "
                f"| {fmt(_median(row, f'role_{role}_pss_mb'))} | " + " | ".join(cells) + " |"
            )
    return lines


def markdown(report: dict[str, Any]) -> list[str]:
    """The cohort runs against as many jobs in-process and through dalid without a cohort,
    then where each run's memory is."""
    rows = cohort_rows(report)
    if not rows:
        return []
    ratios = report["summary"]["ratios"]
    lines = [
        "Cohort: N jobs with the same pipeline, data and sampler seed, each with its own "
        "trainer and DataLoader workers, in-process, through dalid, and through dalid as one "
        "cohort (each batch run once in the daemon), also with one member trailing.",
        "",
        "| jobs | contender | samples/s, all jobs | vs DALI in-process | all processes PSS MiB |",
        "|--:|---|--:|--:|--:|",
    ]
    for row in rows:
        ratio = ratios.get(row["id"], {}).get(f"{BASELINE}-x{row['jobs']}")
        versus = spread_text(ratio, 0, 100) + "%" if ratio and ratio["n"] else NONE
        lines.append(
            f"| {row['jobs']} | {CONTENDERS[row['kind']].label} | "
            f"{spread_text(row['samples_per_s'])} | {versus} | "
            f"{spread_text(row['memory'].get('all_pss_mb'))} |"
        )
    roles = _role_lines(rows)
    if len(roles) == 2:  # results from before the sampler split PSS by role
        return [*lines, ""]
    return [
        *lines,
        "",
        "Where each run's PSS is: by role (the daemon; trainers; DataLoader workers, a "
        "trainer's children; other, their own children) and by kind of page as "
        "/proc/PID/smaps_rollup splits it (anonymous: heaps, a page shared by a trainer and "
        "the workers it forked split among them; file-backed: mapped libraries and files; "
        "shared memory: the daemon's /dev/shm slabs, shared by it and the trainers that map "
        "them). Medians over the timed window's samples, medians over repeats; a role's "
        "figures are its processes together, those alive at each sample (with one member "
        "trailing, the others have mostly ended while it runs on).",
        "",
        *roles,
        "",
    ]
