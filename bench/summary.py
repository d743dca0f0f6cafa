"""From the runs' raw results to the figures the report shows: medians, spreads, ratios.

Throughput of a run with several concurrent jobs is measured over the window in which every
job is past its warm-up and none has finished, counting the batches of all jobs that arrive
in it; when the jobs overlap too little for that, over the union of their timed windows.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from .busy import window_figures as busy_figures
from .contenders import CONTENDERS
from .fill import run_pipelines
from .handles import run_handles
from .measure import LoopResult
from .memory import METRICS as MEMORY_METRICS
from .memory import memory_metrics
from .runner import Outcome
from .scaling import jain_index
from .stats import quantiles, spread
from .targets import DAEMON_OWN_BATCH, all_targets, row_id
from .threads import DAEMON_THREAD_FIGURES
from .threads import figures as daemon_thread_figures
from .threads import window as daemon_thread_window
from .weights import queue_figures, weight_ratio

BASELINE = "dali"  # what the headline ratio compares dalid with
# The daemon's pipelines in a dalid run (bench.fill), summed up over repeats.
PIPELINE_FIGURES = (
    "pipelines", "shared", "jobs_per_pipeline", "threads", "instances", "run_size", "runs",
    "mixed_runs", "mean_fill", "mixed_share",
)  # fmt: skip
PROBES = {
    "os_echo": "OS floor: 1 byte to an echo process over a Unix socketpair",
    "zmq_echo": "ZeroMQ floor: DEALER -> ROUTER echo process over ipc, no dalid",
    "ping": "dalid daemon: bare protocol round trip (ping -> pong)",
    "dalid_b1": "dalid: submit -> ready, 1 tiny sample",
    "dalid_b1_submit": "... of which proxy call + collate (until the batch is sent)",
    "dalid_b1_ready": "... of which waiting for the batch and mapping its output",
    "dali_b1": "DALI in-process pipe.run, 1 tiny sample",
    "dalid_b32": "dalid: submit -> ready, 32 tiny samples",
    "dali_b32": "DALI in-process pipe.run, 32 tiny samples",
    "dalid_gpu_b1": "dalid: submit -> ready, 1 tiny sample as a GPU output, read on the host",
    "dali_gpu_b1": "DALI in-process pipe.run, 1 tiny sample as a GPU output, read on the host",
}


def row_label(kind: str, jobs: int) -> str:
    label = CONTENDERS[kind].label
    return label if jobs == 1 else f"{label}, {jobs} jobs"


def _arrivals(loops: Sequence[LoopResult], start: int, end: int) -> int:
    """Samples of all jobs whose batches arrived in ``(start, end]``."""
    return sum(
        loop.batch_size * sum(1 for stamp in loop.stamps_ns if start < stamp <= end)
        for loop in loops
    )


def window_rates(loops: Sequence[LoopResult]) -> tuple[float, list[float], str]:
    """Samples/s of all jobs together, of each job, and which window measured them.

    In the common window each job's rate is its share of the total while every job ran, so the
    per-job rates add up to the total and show how the jobs shared the machine. In the union
    window (jobs that overlapped too little), each job's rate is over its own timed window.
    """
    if len(loops) == 1:
        return loops[0].samples_per_s, [loops[0].samples_per_s], "timed window"
    common_start = max(loop.start.t_ns for loop in loops)
    common_end = min(loop.end.t_ns for loop in loops)
    typical = statistics.median(loop.end.t_ns - loop.start.t_ns for loop in loops)
    if common_end - common_start >= 0.5 * typical:
        seconds = (common_end - common_start) / 1e9
        per_job = [_arrivals([loop], common_start, common_end) / seconds for loop in loops]
        return sum(per_job), per_job, "common window"
    union_start = min(loop.start.t_ns for loop in loops)
    union_end = max(loop.end.t_ns for loop in loops)
    samples = sum(loop.timed_samples for loop in loops)
    own = [loop.samples_per_s for loop in loops]
    return samples / ((union_end - union_start) / 1e9), own, "union window"


def weighted_metrics(
    loops: Sequence[LoopResult],
    weights: Sequence[float],
    job_ids: Sequence[int],
    queues: Sequence[dict[str, Any]],
) -> dict[str, Any] | None:
    """Jobs of different weights (bench.weights): each job's samples/s over the common window,
    always (the jobs run as long as their weights say, so a share off the weights must not
    fall back to the union window), the heaviest over the lightest against the weights, and
    each job's queue in the daemon meanwhile. None when the weights are equal or the jobs had
    no common window."""
    if len(loops) < 2 or len(set(weights)) < 2:
        return None
    start = max(loop.start.t_ns for loop in loops)
    end = min(loop.end.t_ns for loop in loops)
    if end <= start:
        return None
    seconds = (end - start) / 1e9
    rates = [_arrivals([loop], start, end) / seconds for loop in loops]
    ratio = weight_ratio(rates, weights)
    return {
        "weights": list(weights),
        "rates": rates,
        "window_s": seconds,
        "ratio": ratio["ratio"] if ratio else None,
        "expected": ratio["expected"] if ratio else None,
        "error": ratio["error"] if ratio else None,
        "queues": queue_figures(queues, job_ids, start, end),
    }


def _mean_rate(rates: Sequence[float]) -> float | None:
    return sum(rates) / len(rates) if rates else None


def cohort_hit_rate(readings: Sequence[dict[str, Any]]) -> float | None:
    """The hit rate of the cohort the run's jobs joined, from the last status reading that
    showed it (None: no cohort ran)."""
    for reading in reversed(readings):
        for cohort in reading.get("cohorts") or ():
            return float(cohort["hit_rate"])
    return None


def run_metrics(outcome: Outcome) -> dict[str, Any]:
    """One run's figures; the daemon's CPU per sample is read over the window samples/s is
    counted in (the jobs' common window, else their union), its threads and memory over the
    union of the jobs' windows."""
    loops = [LoopResult.from_dict(result["loop"]) for result in outcome.results]
    rate, shares, method = window_rates(loops)
    timed = sum(loop.timed_samples for loop in loops)
    trainer_cpu = sum(loop.end.trainer_cpu_s - loop.start.trainer_cpu_s for loop in loops)
    workers_cpu = sum(loop.end.workers_cpu_s - loop.start.workers_cpu_s for loop in loops)
    first = min(loops, key=lambda loop: loop.start.t_ns)
    last = max(loops, key=lambda loop: loop.end.t_ns)
    # The daemon's CPU per sample over the window samples/s is counted in. Over the union of
    # several jobs' windows it reads low: the batches that arrive in its first part were made
    # before it began, while its end follows the last batch made.
    daemon_from, daemon_to = first.start, last.end
    if method == "common window":
        daemon_from = max(loops, key=lambda loop: loop.start.t_ns).start
        daemon_to = min(loops, key=lambda loop: loop.end.t_ns).end
    daemon_cpu = daemon_to.daemon_cpu_s - daemon_from.daemon_cpu_s
    daemon_samples = _arrivals(loops, daemon_from.t_ns, daemon_to.t_ns)
    per_sample = {
        "trainer": 1e3 * trainer_cpu / timed,
        "workers": 1e3 * workers_cpu / timed,
        "daemon": 1e3 * daemon_cpu / daemon_samples if daemon_samples else 0.0,
    }
    per_sample["total"] = sum(per_sample.values())
    # The whole machine's busy cores over the jobs' windows, beside what the per-process
    # account implies over the window samples/s is counted in (CPU a sample x samples/s).
    busy = busy_figures(
        outcome.busy,
        [loop.start.t_ns for loop in loops],
        [loop.end.t_ns for loop in loops],
        outcome.kernel_busy,
    )
    busy["account"] = per_sample["total"] * rate / 1e3
    # The daemon's pipelines as the jobs' timed windows ended (dalid only).
    daemon = CONTENDERS[outcome.kind].needs_daemon
    pipelines = run_pipelines(outcome.results) if daemon else None
    # Whole epochs: every loop has the same batches per epoch (bench.measure).
    epochs = len((outcome.results[0].get("handles") or {}).get("slabs_opened") or [1])
    warmup_epochs = loops[0].warmup_batches * epochs // max(1, len(loops[0].stamps_ns))
    weights = [float(result.get("weight", 1.0)) for result in outcome.results]
    job_ids = [(result.get("handles") or {}).get("job_id", -1) for result in outcome.results]
    return {
        "samples_per_s": rate,
        "rate_window": method,
        "per_job_samples_per_s": [loop.samples_per_s for loop in loops],
        "job_share_samples_per_s": shares,
        "fairness": jain_index(shares),
        "intervals_ms": [value for loop in loops for value in loop.intervals_ms],
        "first_batch_s": max(loop.first_batch_s for loop in loops),
        "trainer_cpu_s": trainer_cpu,
        "cpu_ms_per_sample": per_sample,
        "busy_cores": busy,
        "trainer_peak_rss_mb": max(loop.trainer_peak_rss_mb for loop in loops),
        "total_peak_rss_mb": sum(
            loop.trainer_peak_rss_mb + loop.workers_peak_rss_mb for loop in loops
        )
        + max(loop.daemon_peak_rss_mb for loop in loops),
        "memory": memory_metrics(outcome.memory, first.start.t_ns, last.end.t_ns),
        "foreign_cores": outcome.foreign_cores,
        "background_cores": outcome.background_cores,
        "pipelines": pipelines,
        "handles": run_handles(outcome.results, warmup_epochs),
        "weighted": weighted_metrics(loops, weights, job_ids, outcome.queues),
        # A cohort's batches served from another member's run, as the daemon last counted them.
        "hit_rate": cohort_hit_rate(outcome.queues),
        # The daemon's own threads over the union of the jobs' timed windows (bench.threads).
        "daemon_threads": (
            daemon_thread_figures(
                daemon_thread_window(outcome.daemon_threads, first.start.t_ns, last.end.t_ns)
            )
            if daemon
            else None
        ),
        "daemon_threads_used": (
            daemon_thread_window(outcome.daemon_threads, first.start.t_ns, last.end.t_ns)
            if daemon
            else None
        ),
    }


def _transport_metrics(outcome: Outcome) -> dict[str, dict[str, float]]:
    return {probe: quantiles(times) for probe, times in outcome.results[0]["transport"].items()}


def summarize(
    outcomes: Sequence[Outcome],
    gpu: bool = False,
    batch_size: int = DAEMON_OWN_BATCH,
    profile: str = "cpu",
) -> dict[str, Any]:
    """Rows per contender, the transport table, the ratio matrix and the targets (those of a
    GPU where ``gpu``; the daemon's threads' at the run's ``batch_size``; the ``profile``'s)."""
    by_row: dict[tuple[str, int], list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        by_row[(outcome.kind, outcome.jobs)].append(outcome)

    rows: list[dict[str, Any]] = []
    rates: dict[str, dict[int, float]] = {}
    values: dict[str, dict[int, dict[str, float | None]]] = {}  # see targets.Values
    transport: dict[str, Any] = {}
    for (kind, jobs), runs in by_row.items():
        good = [run for run in runs if run.error is None and run.results]
        errors = [f"repeat {run.repeat}: {run.error}" for run in runs if run.error]
        if kind == "transport":
            probes = [_transport_metrics(run) for run in good]
            transport = {
                "probes": {
                    probe: {
                        "description": PROBES[probe],
                        "p50_us": spread(p[probe]["p50"] for p in probes),
                        "p99_us": spread(p[probe]["p99"] for p in probes),
                        "mean_us": spread(p[probe]["mean"] for p in probes),
                    }
                    for probe in PROBES
                    if probes and probe in probes[0]
                },
                "runs": probes,
                "errors": errors,
            }
            continue
        metrics = [run_metrics(run) for run in good]
        row_key = row_id(kind, jobs)
        rates[row_key] = {
            run.repeat: m["samples_per_s"] for run, m in zip(good, metrics, strict=True)
        }
        values[row_key] = {
            run.repeat: {
                "samples_per_s": m["samples_per_s"],
                "fairness": m["fairness"],
                "all_pss_mb": m["memory"].get("all_pss_mb"),
                "daemon_peak_rss_mb": m["memory"].get("daemon_peak_rss_mb"),
                "cpu_ms_per_sample": m["cpu_ms_per_sample"]["total"],
                "all_gpu_mb": m["memory"].get("all_gpu_mb"),
                "trainers_gpu_mb": m["memory"].get("trainers_gpu_mb"),
                "gpu_busy_pct": m["memory"].get("gpu_busy_pct"),
                **_handle_values(m["handles"]),
                "weight_ratio": (m["weighted"] or {}).get("ratio"),
                "weight_expected": (m["weighted"] or {}).get("expected"),
                **(m["daemon_threads"] or {}),
                "batches_copied": (m["pipelines"] or {}).get("batches_copied"),
                "hit_rate": m["hit_rate"],
                # The mean samples/s of the jobs that do not trail (a trailing run's job 0 does).
                "members_per_job": _mean_rate(
                    m["per_job_samples_per_s"][1 if run.kind.endswith("-trailing") else 0 :]
                ),
            }
            for run, m in zip(good, metrics, strict=True)
        }
        intervals = [value for m in metrics for value in m["intervals_ms"]]
        rows.append(
            {
                "id": row_key,
                "kind": kind,
                "label": row_label(kind, jobs),
                "jobs": jobs,
                "samples_per_s": spread(m["samples_per_s"] for m in metrics),
                "per_job_samples_per_s": spread(
                    v for m in metrics for v in m["per_job_samples_per_s"]
                ),
                "job_share_samples_per_s": spread(
                    v for m in metrics for v in m["job_share_samples_per_s"]
                ),
                "fairness": spread(m["fairness"] for m in metrics),
                "rate_windows": sorted({m["rate_window"] for m in metrics}),
                "interval_ms": quantiles(intervals) if intervals else {},
                "first_batch_s": spread(m["first_batch_s"] for m in metrics),
                "trainer_cpu_s": spread(m["trainer_cpu_s"] for m in metrics),
                "cpu_ms_per_sample": {
                    part: spread(m["cpu_ms_per_sample"][part] for m in metrics)
                    for part in ("trainer", "workers", "daemon", "total")
                },
                "trainer_peak_rss_mb": spread(m["trainer_peak_rss_mb"] for m in metrics),
                "total_peak_rss_mb": spread(m["total_peak_rss_mb"] for m in metrics),
                "memory": _memory_spreads([m["memory"] for m in metrics]),
                "foreign_cores": spread(m["foreign_cores"] for m in metrics),
                "background_cores": spread(m["background_cores"] for m in metrics),
                "busy_cores": {
                    part: spread(
                        m["busy_cores"][part] for m in metrics if m["busy_cores"][part] is not None
                    )
                    for part in ("common", "union", "account", "kernel_threads")
                },
                "pipelines": _pipeline_spreads([m["pipelines"] for m in metrics]),
                "pipelines_per_run": [
                    {"repeat": run.repeat, **m["pipelines"]}
                    for run, m in zip(good, metrics, strict=True)
                    if m["pipelines"] is not None
                ],
                "weighted": _weighted_spreads([m["weighted"] for m in metrics]),
                "daemon_threads": _thread_spreads([m["daemon_threads"] for m in metrics]),
                "daemon_threads_per_run": [
                    {"repeat": run.repeat, **m["daemon_threads_used"]}
                    for run, m in zip(good, metrics, strict=True)
                    if m["daemon_threads_used"]
                ],
                "weighted_per_run": [
                    {"repeat": run.repeat, **m["weighted"]}
                    for run, m in zip(good, metrics, strict=True)
                    if m["weighted"] is not None
                ],
                "handles_per_run": [
                    {"repeat": run.repeat, **m["handles"]}
                    for run, m in zip(good, metrics, strict=True)
                    if m["handles"] is not None
                ],
                "errors": errors,
            }
        )
    labels = {kind: contender.label for kind, contender in CONTENDERS.items()}
    return {
        "rows": rows,
        "ratios": _ratios(rates),
        "transport": transport,
        "targets": all_targets(
            values, transport, labels, gpu=gpu, batch_size=batch_size, profile=profile
        ),
    }


def _handle_values(handles: dict[str, Any] | None) -> dict[str, float | None]:
    """The handle figures the targets read (bench.handles), None where not counted."""
    if handles is None:
        return {"handle_opens": None, "handle_timed_opens": None, "slabs": None}
    return {
        "handle_opens": handles["opens"],
        "handle_timed_opens": handles["timed_opens"],
        "slabs": handles["slabs"],
    }


def _weighted_spreads(runs: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The weighted figures over repeats: the ratio and its error, and per job (in the order of
    the run's jobs) its samples/s, median queued batches and share of readings backlogged;
    None for a run of equal weights."""
    read = [run for run in runs if run is not None]
    if not read:
        return None
    jobs = range(len(read[0]["weights"]))

    def per_job(name: str) -> list[dict[str, float]]:
        return [
            spread(q[name] for run in read if (q := run["queues"][job]) is not None) for job in jobs
        ]

    return {
        "weights": read[0]["weights"],
        "ratio": spread(run["ratio"] for run in read if run["ratio"] is not None),
        "error": spread(run["error"] for run in read if run["error"] is not None),
        "rates": [spread(run["rates"][job] for run in read) for job in jobs],
        "queued": per_job("queued"),
        "backlogged": per_job("backlogged"),
    }


def _thread_spreads(runs: Sequence[dict[str, Any] | None]) -> dict[str, dict[str, float]]:
    """The daemon's own threads' figures (bench.threads) over the repeats that have them."""
    return {
        name: spread(v for run in runs if (v := (run or {}).get(name)) is not None)
        for name in DAEMON_THREAD_FIGURES
    }


def _memory_spreads(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each memory figure over repeats; runs where it could not be read are left out."""
    return {
        name: spread(run[name] for run in runs if run.get(name) is not None)
        for name in MEMORY_METRICS
    }


def _pipeline_spreads(runs: Sequence[dict[str, Any] | None]) -> dict[str, dict[str, float]]:
    """The daemon's pipeline figures over repeats (bench.fill); empty for a contender without a
    daemon, and a figure no run could read has n = 0."""
    read = [run["figures"] for run in runs if run is not None and run["figures"] is not None]
    if all(run is None for run in runs):
        return {}
    return {
        name: spread(run[name] for run in read if run[name] is not None)
        for name in PIPELINE_FIGURES
    }


def _ratios(rates: dict[str, dict[int, float]]) -> dict[str, dict[str, dict[str, float]]]:
    """Throughput of each row over each other, paired by repeat (they ran back to back)."""
    matrix: dict[str, dict[str, dict[str, float]]] = {}
    for a, a_rates in rates.items():
        matrix[a] = {}
        for b, b_rates in rates.items():
            paired = [a_rates[r] / b_rates[r] for r in a_rates if r in b_rates and b_rates[r] > 0]
            matrix[a][b] = spread(paired)
    return matrix
