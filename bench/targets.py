"""The targets a run is held to, each marked met or not from the run's medians.

A target compares figures of rows of the summary (``row_id``: ``dalid``, ``dali-x8``, ...).
Ratios between two rows pair their runs by repeat (they ran back to back) and take the median
of the per-repeat ratios, as the throughput matrix does. A target whose rows did not run, or
ran without the figure, is *not measured*: ``met`` is None, never True. Plain data in and out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .stats import spread
from .weights import JOB_WEIGHTS, TOLERANCE, WEIGHTS, within

# One job through dalid against DALI in-process (on a GPU, GPU_RATIO_TARGET) and DALI's
# proxy, and what it costs all processes.
RATIO_TARGET = 0.97
GPU_RATIO_TARGET = 0.98
PROXY_RATIO_TARGET = 1.0
CPU_RATIO_TARGET = 1.05  # all processes' CPU per sample over DALI in-process's, at most
# The transport's round trip of a tiny batch, against the floors measured in the same run: a
# bare ZeroMQ echo for one sample, DALI's own pipe.run of the same batch for 32.
ECHO_P50_TARGET = 2.0
ECHO_P99_TARGET = 3.0
PIPE_RUN_B32_TARGET = 1.5

# Jobs sharing one pipeline in the daemon (``dalid``, sharing on by default), against as many
# jobs each running DALI in its own process (``dali``). On a CPU machine in-process DALI keeps
# every core busy already, so parity in throughput is the ceiling there and the win is memory.
SHARED_THROUGHPUT_JOBS = (2, 4, 8)
SHARED_THROUGHPUT_TARGET = 1.0  # all jobs' samples/s over in-process's, at least
MEMORY_JOBS = 8
PSS_TARGET = 0.60  # all processes' PSS over in-process's with MEMORY_JOBS jobs, at most
DAEMON_GROWTH_TARGET = 1.5  # the daemon's peak RSS with MEMORY_JOBS jobs over 1 job, at most
FAIRNESS_JOBS = (2, 4, 8)
FAIRNESS_TARGET = 0.99  # Jain's index at equal weights, at least
# Two busy jobs of weights 1 and 3 sharing one pipeline (bench.weights): the heavy job's
# samples/s over the light job's, within TOLERANCE of the ratio of their weights.
WEIGHT_RATIO = max(JOB_WEIGHTS) / min(JOB_WEIGHTS)
# The rows these targets need: any of them in a run brings them into its report.
SHARING_KINDS = ("dali", "dalid", "dalid-private", WEIGHTS)

# On a GPU: DALI's QA decoder configuration through dalid, at least DALI's own QA floor on an
# H100 in-process; 8 jobs sharing a pipeline against 8 in-process jobs, in throughput and in
# the GPU memory of all their processes (nvidia-smi, per process).
QA_TARGET = 19_000.0
QA_KINDS = ("dali-qa", "dalid-qa")
GPU_SHARED_JOBS = 8
GPU_SHARED_TARGET = 1.2
GPU_MEMORY_TARGET = 0.5
# Each dalid job past the first adds at most this share of the GPU memory an in-process job
# adds beyond its own CUDA context (a dalid trainer's GPU memory is its context: outputs it
# maps through CUDA IPC are charged to the daemon that made them).
GPU_ADDED_PER_JOB_TARGET = 0.5

# Jobs that read the same data through the same pipeline as one cohort (``dalid-cohort``: each
# batch runs once in the daemon) against as many in-process DALI jobs, at COHORT_JOBS jobs on a
# CPU (throughput and all processes' PSS) and GPU_COHORT_JOBS on a GPU (CoorDL's 5.7x for 8
# jobs is the anchor); and the share of batches served without a run.
COHORT_JOBS = 4
COHORT_THROUGHPUT_TARGET = 3.0
COHORT_PSS_TARGET = 0.60
GPU_COHORT_JOBS = 8
GPU_COHORT_TARGET = 5.0
COHORT_HIT_SHARE = 0.9  # of the ideal (N-1)/N, at least
# One member trailing past the window (``dalid-cohort-trailing``): the others' samples/s per job
# over the cohort's without it, at least.
TRAILING_TARGET = 0.9

# The small profile (config.SMALL: small JPEGs to 32x32 at batch 256, batches tens of times a
# second): one dalid job against DALI in-process and DALI's proxy (RATIO_TARGET,
# PROXY_RATIO_TARGET, as one_job_targets), and SMALL_JOBS jobs sharing one pipeline against
# as many in-process jobs, at least SMALL_SHARED_TARGET (on the 2-core machine the CPU profile's
# parity is the ceiling, and the daemon's per-batch work shows at this batch rate).
SMALL_JOBS = 4
SMALL_SHARED_TARGET = 0.97

# The daemon's own threads (bench.threads: its I/O thread and its pipelines' executors, not
# DALI's workers, nor the copies of output bytes into the jobs' memory, which grow with the
# outputs and not with the Python per batch), held at batch 256 with file-path samples, with
# DAEMON_THREAD_JOBS jobs: CPU per sample at most, and the I/O thread's wall time per message over
# its CPU time at most (above it, the thread waits for the GIL more than it runs).
DAEMON_OWN_US_TARGET = 5.0
# The batch the own-threads goal is set at: the GPU profile's, where a batch's costs are spread
# over 256 samples. At another batch the figure is shown, and the goal does not apply.
DAEMON_OWN_BATCH = 256
DAEMON_THREAD_JOBS = (1, 8)
IO_WALL_OVER_CPU_TARGET = 2.0
IO_WALL_JOBS = 8

# Per row id, per repeat, the run's figures: samples_per_s, fairness, all_pss_mb,
# daemon_peak_rss_mb, cpu_ms_per_sample (all processes), the slab handles (bench.handles)
# and on a GPU all_gpu_mb (None where a figure could not be read).
Values = Mapping[str, Mapping[int, Mapping[str, float | None]]]


def row_id(kind: str, jobs: int) -> str:
    """The summary's name of a contender's row with ``jobs`` jobs: ``dalid``, ``dali-x8``."""
    return kind if jobs == 1 else f"{kind}-x{jobs}"


def row_kind(row: str) -> str:
    """The contender of a row id: ``dalid-private-x4`` -> ``dalid-private``."""
    kind, _, jobs = row.rpartition("-x")
    return kind if kind and jobs.isdigit() else row


def figure(values: Values, row: str, name: str) -> dict[str, float]:
    """A figure of one row over its repeats."""
    runs = values.get(row, {}).values()
    return spread(v for run in runs if (v := run.get(name)) is not None)


def paired_ratio(values: Values, row: str, base: str, name: str) -> dict[str, float]:
    """``row``'s figure over ``base``'s, per repeat where both have it, over the repeats."""
    mine, theirs = values.get(row, {}), values.get(base, {})
    ratios = []
    for repeat, run in mine.items():
        a = run.get(name)
        b = theirs.get(repeat, {}).get(name)
        if a is not None and b is not None and b > 0:
            ratios.append(a / b)
    return spread(ratios)


def at_least(goal: float) -> Callable[[float], bool]:
    return lambda measured: measured >= goal


def at_most(goal: float) -> Callable[[float], bool]:
    return lambda measured: measured <= goal


def target(
    name: str, goal: str, measured: dict[str, float], unit: str, met: Callable[[float], bool]
) -> dict[str, Any]:
    """A target's row; ``unit`` says how the report shows it: "ratio" (as %), "times",
    "index", "us", "rate" (samples/s) or "count"."""
    if not measured.get("n"):
        return {"name": name, "goal": goal, "measured": None, "unit": unit, "met": None}
    return {"name": name, "goal": goal, "measured": measured, "unit": unit,
            "met": bool(met(measured["median"]))}  # fmt: skip


def sharing_targets(values: Values, labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """Jobs sharing one pipeline in the daemon: throughput against as many in-process DALI
    jobs, memory, and fairness; ``labels`` names the contenders by kind."""
    shared, inprocess = labels["dalid"], labels["dali"]
    found = [
        target(
            f"{shared}, {jobs} jobs: samples/s / {inprocess}, {jobs} jobs",
            f">= {SHARED_THROUGHPUT_TARGET:.0%}",
            paired_ratio(values, row_id("dalid", jobs), row_id("dali", jobs), "samples_per_s"),
            "ratio",
            lambda ratio: ratio >= SHARED_THROUGHPUT_TARGET,
        )
        for jobs in SHARED_THROUGHPUT_JOBS
    ]
    n = MEMORY_JOBS
    found.append(
        target(
            f"{shared}, {n} jobs: all processes' PSS / {inprocess}, {n} jobs",
            f"<= {PSS_TARGET:.0%}",
            paired_ratio(values, row_id("dalid", n), row_id("dali", n), "all_pss_mb"),
            "ratio",
            lambda ratio: ratio <= PSS_TARGET,
        )
    )
    found.append(
        target(
            f"{shared}: the daemon's peak RSS with {n} jobs / with 1 job",
            f"<= {DAEMON_GROWTH_TARGET:.1f}x",
            paired_ratio(values, row_id("dalid", n), "dalid", "daemon_peak_rss_mb"),
            "times",
            lambda ratio: ratio <= DAEMON_GROWTH_TARGET,
        )
    )
    found += [
        target(
            f"{shared}, {jobs} jobs of equal weight: Jain's fairness",
            f">= {FAIRNESS_TARGET}",
            figure(values, row_id("dalid", jobs), "fairness"),
            "index",
            lambda index: index >= FAIRNESS_TARGET,
        )
        for jobs in FAIRNESS_JOBS
    ]
    found.append(weight_target(values, labels))
    return found


def weight_target(values: Values, labels: Mapping[str, str]) -> dict[str, Any]:
    """Two busy jobs of weights 1 and 3 on one shared pipeline: the heavy job's samples/s over
    the light job's, within ``TOLERANCE`` of 3 (not measured where the weighted run did not
    run)."""
    light, heavy = (f"{w:g}" for w in sorted(JOB_WEIGHTS))
    low, high = WEIGHT_RATIO * (1 - TOLERANCE), WEIGHT_RATIO * (1 + TOLERANCE)
    return target(
        f"{labels['dalid']}, 2 jobs of weights {light} and {heavy}: samples/s of the heavy "
        "job / of the light job",
        f"{WEIGHT_RATIO:.1f}x ± {TOLERANCE:.0%} ({low:.2f}-{high:.2f}x)",
        figure(values, row_id(WEIGHTS, len(JOB_WEIGHTS)), "weight_ratio"),
        "times",
        lambda ratio: within(ratio / WEIGHT_RATIO - 1),
    )


def one_job_targets(
    values: Values, labels: Mapping[str, str], gpu: bool = False
) -> list[dict[str, Any]]:
    """One job through dalid against DALI in-process and DALI's proxy: throughput, and the CPU
    of all processes per sample. A target whose rows did not run is left out."""
    found = []
    dalid, dali, proxy = labels["dalid"], labels["dali"], labels["dali-proxy"]
    throughput = (
        ("dali", dali, GPU_RATIO_TARGET if gpu else RATIO_TARGET),
        ("dali-proxy", proxy, PROXY_RATIO_TARGET),
    )
    for base, label, goal in throughput:
        ratio = paired_ratio(values, "dalid", base, "samples_per_s")
        if ratio["n"]:
            found.append(
                target(
                    f"{dalid}, 1 job: samples/s / {label}, 1 job",
                    f">= {goal:.0%}",
                    ratio,
                    "ratio",
                    at_least(goal),
                )
            )
    cpu = paired_ratio(values, "dalid", "dali", "cpu_ms_per_sample")
    if cpu["n"]:
        found.append(
            target(
                f"{dalid}, 1 job: all processes' CPU per sample / {dali}, 1 job",
                f"<= {CPU_RATIO_TARGET:.2f}x",
                cpu,
                "times",
                lambda r: r <= CPU_RATIO_TARGET,
            )
        )
    return found


def transport_targets(transport: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A tiny batch's round trip through dalid against the floors of the same run (ratios of
    the run's quantiles, per repeat); none where the transport probes did not run."""
    runs = transport.get("runs") or []

    def ratio(probe: str, base: str, quantile: str) -> dict[str, float]:
        return spread(
            run[probe][quantile] / run[base][quantile]
            for run in runs
            if probe in run and base in run and run[base][quantile] > 0
        )

    goals = (
        ("1 tiny sample, p50", "dalid_b1", "zmq_echo", "p50", "the ZeroMQ echo", ECHO_P50_TARGET),
        ("1 tiny sample, p99", "dalid_b1", "zmq_echo", "p99", "the ZeroMQ echo", ECHO_P99_TARGET),
        ("32 tiny samples, p50", "dalid_b32", "dali_b32", "p50", "DALI's pipe.run",
         PIPE_RUN_B32_TARGET),
    )  # fmt: skip
    found = []
    for what, probe, base, quantile, floor, goal in goals:
        measured = ratio(probe, base, quantile)
        if measured["n"]:
            found.append(
                target(
                    f"transport: submit -> ready, {what} / {floor}, {quantile}",
                    f"<= {goal:.1f}x",
                    measured,
                    "times",
                    at_most(goal),
                )
            )
    return found


def handle_targets(values: Values, labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """One dalid job's slab handles: each slab opened once, none after the warm-up epoch
    (bench.handles); no targets where the runs counted none."""
    runs = values.get("dalid", {}).values()
    counted = [run for run in runs if run.get("handle_opens") is not None]
    if not counted:
        return []
    name = f"{labels['dalid']}, 1 job"
    per_slab = spread(
        (run["handle_opens"] or 0.0) / slabs for run in counted if (slabs := run.get("slabs"))
    )
    timed = spread(opens for run in counted if (opens := run.get("handle_timed_opens")) is not None)
    return [
        target(
            f"{name}: slab handles opened / slabs of its pool (each opened once)",
            "= 100%",
            per_slab,
            "ratio",
            lambda ratio: ratio == 1.0,
        ),
        target(
            f"{name}: slab handles opened after the warm-up epoch",
            "= 0",
            timed,
            "count",
            # Every repeat, not only the median one.
            lambda _: timed["max"] == 0,
        ),
    ]


def gpu_targets(values: Values, labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """What a GPU run is held to beyond the others: the QA configuration's throughput (through
    dalid, and DALI's own in-process), and 8 shared jobs against 8 in-process ones."""
    found = [
        target(
            f"{labels[kind]}: samples/s",
            f">= {QA_TARGET:,.0f}",
            figure(values, kind, "samples_per_s"),
            "rate",
            lambda rate: rate >= QA_TARGET,
        )
        for kind in reversed(QA_KINDS)
        if kind in values
    ]
    if any(row_kind(row) in SHARING_KINDS for row in values):
        n, shared, inprocess = GPU_SHARED_JOBS, labels["dalid"], labels["dali"]
        found += [
            target(
                f"{shared}, {n} jobs: samples/s / {inprocess}, {n} jobs (GPU)",
                f">= {GPU_SHARED_TARGET:.0%}",
                paired_ratio(values, row_id("dalid", n), row_id("dali", n), "samples_per_s"),
                "ratio",
                lambda ratio: ratio >= GPU_SHARED_TARGET,
            ),
            target(
                f"{shared}, {n} jobs: GPU memory of all processes / {inprocess}, {n} jobs",
                f"<= {GPU_MEMORY_TARGET:.0%}",
                paired_ratio(values, row_id("dalid", n), row_id("dali", n), "all_gpu_mb"),
                "ratio",
                lambda ratio: ratio <= GPU_MEMORY_TARGET,
            ),
            target(
                f"{shared}: GPU memory each job past the first adds, beyond its trainer's CUDA "
                f"context / what an {inprocess} job adds beyond its own ({n} jobs and 1)",
                f"<= {GPU_ADDED_PER_JOB_TARGET:.0%}",
                added_gpu_ratio(values, n),
                "ratio",
                lambda ratio: ratio <= GPU_ADDED_PER_JOB_TARGET,
            ),
        ]
    return found


def added_gpu_ratio(values: Values, jobs: int) -> dict[str, float]:
    """Per repeat: ``(all(dalid x jobs) - all(dalid)) / (jobs - 1) - context`` over
    ``all(dali) - context``, where ``all`` is the GPU memory of all of a run's processes and
    ``context`` a dalid trainer's own (``trainers_gpu_mb`` of one dalid job: its CUDA context
    and torch's, which an in-process job has too); over the repeats where all were read."""
    many, one, alone = (
        values.get(row_id("dalid", jobs), {}),
        values.get("dalid", {}),
        values.get("dali", {}),
    )
    ratios = []
    for repeat, run in many.items():
        figures = (
            run.get("all_gpu_mb"),
            one.get(repeat, {}).get("all_gpu_mb"),
            one.get(repeat, {}).get("trainers_gpu_mb"),
            alone.get(repeat, {}).get("all_gpu_mb"),
        )
        if jobs < 2 or any(figure is None for figure in figures):
            continue
        total, first, context, inprocess = (float(f) for f in figures)  # type: ignore[arg-type]
        beyond_context = inprocess - context
        if beyond_context > 0:
            ratios.append(((total - first) / (jobs - 1) - context) / beyond_context)
    return spread(ratios)


def daemon_thread_targets(
    values: Values, labels: Mapping[str, str], batch_size: int = DAEMON_OWN_BATCH
) -> list[dict[str, Any]]:
    """The daemon's own threads' CPU per sample and its I/O thread's wall over CPU time per
    message (bench.threads), for the dalid rows that ran. The CPU per sample is named with the
    run's batch; its goal is set at ``DAEMON_OWN_BATCH`` (file paths), and at another batch it
    is shown without being judged: most of it is per batch, so a batch of 32 reads about eight
    times as much a sample for the same code."""
    shared = labels["dalid"]
    found = [
        target(
            f"{shared}, {jobs} job{'s' if jobs > 1 else ''}: the daemon's own threads' CPU per "
            f"sample (I/O + executors less output copies; batch {batch_size}, file paths)",
            f"<= {DAEMON_OWN_US_TARGET:g} us",
            figure(values, row_id("dalid", jobs), "daemon_own_us_per_sample"),
            "us.1",
            at_most(DAEMON_OWN_US_TARGET),
        )
        for jobs in DAEMON_THREAD_JOBS
        if row_id("dalid", jobs) in values
    ]
    if batch_size != DAEMON_OWN_BATCH:
        for row in found:
            row["met"] = None
            row["why"] = f"goal set at batch {DAEMON_OWN_BATCH}"
    # No batch as a private copy (Note [Private copies] in the daemon): counted by the daemon
    # per job from its start, so a copy in the warm-up counts too.
    found += [
        target(
            f"{shared}, {jobs} job{'s' if jobs > 1 else ''}: batches delivered as private copies",
            "= 0",
            figure(values, row_id("dalid", jobs), "batches_copied"),
            "count",
            at_most(0),
        )
        for jobs in DAEMON_THREAD_JOBS
        if row_id("dalid", jobs) in values
    ]
    if row_id("dalid", IO_WALL_JOBS) in values:
        found.append(
            target(
                f"{shared}, {IO_WALL_JOBS} jobs: the I/O thread's wall time per message / its "
                "CPU time",
                f"<= {IO_WALL_OVER_CPU_TARGET:g}x",
                figure(values, row_id("dalid", IO_WALL_JOBS), "io_wall_over_cpu"),
                "times",
                at_most(IO_WALL_OVER_CPU_TARGET),
            )
        )
    return found


def cohort_targets(
    values: Values, labels: Mapping[str, str], gpu: bool = False
) -> list[dict[str, Any]]:
    """A cohort's jobs against as many in-process DALI jobs: throughput, memory (CPU) and the
    share of batches served without a run (not measured where the rows did not run)."""
    cohort, inprocess = labels["dalid-cohort"], labels["dali"]
    n = GPU_COHORT_JOBS if gpu else COHORT_JOBS
    goal = GPU_COHORT_TARGET if gpu else COHORT_THROUGHPUT_TARGET
    found = [
        target(
            f"{cohort}, {n} jobs: samples/s / {inprocess}, {n} jobs",
            f">= {goal:.1f}x",
            paired_ratio(values, row_id("dalid-cohort", n), row_id("dali", n), "samples_per_s"),
            "times",
            at_least(goal),
        )
    ]
    if not gpu:
        found.append(
            target(
                f"{cohort}, {n} jobs: all processes' PSS / {inprocess}, {n} jobs",
                f"<= {COHORT_PSS_TARGET:.0%}",
                paired_ratio(values, row_id("dalid-cohort", n), row_id("dali", n), "all_pss_mb"),
                "ratio",
                at_most(COHORT_PSS_TARGET),
            )
        )
    found.append(
        target(
            f"{labels['dalid-cohort-trailing']}, {n} jobs: samples/s per job of the others / "
            f"{cohort}, {n} jobs",
            f">= {TRAILING_TARGET:.0%}",
            paired_ratio(
                values,
                row_id("dalid-cohort-trailing", n),
                row_id("dalid-cohort", n),
                "members_per_job",
            ),
            "ratio",
            at_least(TRAILING_TARGET),
        )
    )
    ideal = (n - 1) / n
    found.append(
        target(
            f"{cohort}, {n} jobs: batches served from another job's run",
            f">= {COHORT_HIT_SHARE * ideal:.0%}",
            figure(values, row_id("dalid-cohort", n), "hit_rate"),
            "ratio",
            at_least(COHORT_HIT_SHARE * ideal),
        )
    )
    return found


def small_targets(values: Values, labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """The small profile's beyond one job's: ``SMALL_JOBS`` jobs sharing one pipeline in the
    daemon against as many in-process DALI jobs (not measured where they did not run)."""
    n, shared, inprocess = SMALL_JOBS, labels["dalid"], labels["dali"]
    return [
        target(
            f"{shared}, {n} jobs: samples/s / {inprocess}, {n} jobs (small profile)",
            f">= {SMALL_SHARED_TARGET:.0%}",
            paired_ratio(values, row_id("dalid", n), row_id("dali", n), "samples_per_s"),
            "ratio",
            at_least(SMALL_SHARED_TARGET),
        )
    ]


def all_targets(
    values: Values,
    transport: Mapping[str, Any],
    labels: Mapping[str, str],
    gpu: bool = False,
    batch_size: int = DAEMON_OWN_BATCH,
    *,
    profile: str = "cpu",
) -> list[dict[str, Any]]:
    """The run's targets: one job and the transport where they ran, the sharing targets where
    any of their contenders ran (those of job counts not run: not measured; in the small
    ``profile`` its own instead), the slab handles of one dalid job, the daemon's threads (at
    the run's ``batch_size``), and on a GPU (``gpu``) the GPU targets."""
    found = one_job_targets(values, labels, gpu) + transport_targets(transport)
    if profile == "small":
        found += small_targets(values, labels)
    elif any(row_kind(row) in SHARING_KINDS for row in values):
        found += sharing_targets(values, labels)
    found += handle_targets(values, labels)
    found += daemon_thread_targets(values, labels, batch_size)
    if any(row_kind(row).startswith("dalid-cohort") for row in values):
        found += cohort_targets(values, labels, gpu)
    if gpu:
        found += gpu_targets(values, labels)
    return found


def met_text(met: bool | None, why: str | None = None) -> str:
    """How the report's ``met`` column shows a target (``why``: why it was not judged)."""
    if met is None:
        return f"n/a: {why}" if why else "not measured"
    return "yes" if met else "**no**"
