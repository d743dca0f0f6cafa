"""The scaling runs: N training jobs through one dalid daemon against N jobs with DALI each.

For every job count the bench runs ``dali``, ``dalid`` (the jobs share one pipeline in the
daemon) and ``dalid-private`` (each job a pipeline of its own in the daemon), and on the GPU
profile ``dali-proxy`` (each job DALI's proxy in its own process), with that many
concurrent trainers (the same runs as the multi-job contenders), and reports their throughput,
how evenly the jobs shared it (Jain's fairness index), the memory every process used and how
full the daemon's pipeline runs were. The logic here is plain data in and out, so that it can
be tested without running anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

SCALING = "scaling"  # the --only key that adds the scaling runs
# The contenders run once per job count, and as the multi-job contenders (--jobs), of those a
# profile names (Settings.scaled: the CPU profile's dali, dalid and dalid-private; the GPU
# profile's dali, dali-proxy and dalid).
SCALED = ("dali", "dali-proxy", "dalid", "dalid-private")
CPU_SCALED = ("dali", "dalid", "dalid-private")
# --only cohort: jobs that read the same data through the same pipeline, in-process, through
# dalid, and through dalid as one cohort (each batch run once), also with one member trailing,
# at every --scaling-jobs count.
COHORT_RUNS = "cohort"
COHORT_KINDS = ("dali", "dalid", "dalid-cohort", "dalid-cohort-trailing")


def jain_index(rates: Sequence[float]) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)`` over per-job throughputs.

    1 when every job gets the same throughput, ``1/n`` when one job gets all of it; NaN when
    every rate is zero (nothing to share).
    """
    if not rates:
        raise ValueError("Jain's index needs at least one rate")
    if any(rate < 0 for rate in rates):
        raise ValueError(f"throughputs cannot be negative: {list(rates)}")
    squares = sum(rate * rate for rate in rates)
    if squares == 0:
        return float("nan")
    return sum(rates) ** 2 / (len(rates) * squares)


def parse_job_counts(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)``: positive, without repeats, in increasing order."""
    try:
        counts = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise ValueError(f"job counts are comma-separated integers, not {text!r}") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"job counts must be at least 1: {text!r}")
    return tuple(sorted(counts))


def add_scaling_runs(
    runs: Iterable[tuple[str, int]], job_counts: Iterable[int], kinds: Sequence[str] = CPU_SCALED
) -> list[tuple[str, int]]:
    """``runs`` followed by a run of each of ``kinds`` (of ``SCALED``; the CPU profile's by
    default) per job count, none twice."""
    planned = list(runs)
    for jobs in job_counts:
        for kind in kinds:
            if (kind, jobs) not in planned:
                planned.append((kind, jobs))
    return planned
