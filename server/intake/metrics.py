"""Prometheus metrics over HTTP (``dalid serve --metrics-port``): the figures of ``dalid status``.

The endpoint serves the daemon's latest status snapshot, which the I/O thread refreshes every
second; the HTTP thread never touches the daemon's state. It carries counters only, never buffer
handles or job tokens, and listens only when asked for (on 127.0.0.1 unless told otherwise).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from dalid.protocol import JobStatus, StatusReport

# (metric, help, kind, field of JobStatus); counters get Prometheus' "_total" suffix. A field
# that is None (a trainer that does not say how many workers it started) gives no series.
JOB_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("dalid_job_batches", "Batches delivered to the job", "counter", "batches_done"),
    ("dalid_job_samples", "Samples delivered to the job", "counter", "samples_done"),
    ("dalid_job_batches_failed", "Batches of the job that failed", "counter", "batches_failed"),
    ("dalid_job_samples_per_second", "Samples per second, recent", "gauge", "samples_per_second"),
    ("dalid_job_batches_queued", "Batches waiting for their pipeline", "gauge", "queued"),
    ("dalid_job_batches_running", "Batches inside DALI", "gauge", "running"),
    ("dalid_job_batches_waiting", "Batches held back over the job's limit", "gauge", "waiting"),
    ("dalid_job_run_seconds", "Daemon time the job's batches took", "counter", "run_seconds"),
    ("dalid_job_slot_wait_seconds", "Batches' wait for other jobs", "counter", "slot_wait_seconds"),
    ("dalid_job_trainer_wait_seconds", "Wait for data", "counter", "trainer_wait_seconds"),
    ("dalid_job_regions_held", "Output buffers the trainer holds", "gauge", "regions_held"),
    ("dalid_job_bytes_held", "Bytes of output buffers the trainer holds", "gauge", "bytes_held"),
    ("dalid_job_memory_bytes", "Output memory reserved for the job", "gauge", "memory_bytes"),
    ("dalid_job_workers", "DataLoader workers connected", "gauge", "workers"),
    ("dalid_job_workers_started", "DataLoader workers started", "gauge", "workers_started"),
)  # fmt: skip


# (metric, help, kind, field of PipelineStatus), one series per pipeline in the daemon.
PIPELINE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("dalid_pipeline_runs", "Runs of the pipeline", "counter", "runs"),
    ("dalid_pipeline_samples", "Samples the pipeline ran", "counter", "samples"),
    ("dalid_pipeline_mixed_runs", "Runs holding several jobs' batches", "counter", "mixed_runs"),
    ("dalid_pipeline_run_size", "The most samples one run holds", "gauge", "run_size"),
    ("dalid_pipeline_mean_fill", "Samples of its runs over their run size", "gauge", "mean_fill"),
    ("dalid_pipeline_jobs", "Jobs whose registrations the pipeline runs", "gauge", "jobs"),
    ("dalid_pipeline_instances", "DALI instances running the pipeline", "gauge", "instances"),
)  # fmt: skip

COHORT_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("dalid_cohort_jobs", "Jobs in the cohort", "gauge", "jobs"),
    ("dalid_cohort_runs", "Batches of the cohort's members that ran", "counter", "runs"),
    ("dalid_cohort_hits", "Batches served from another member's run", "counter", "hits"),
    ("dalid_cohort_hit_rate", "Hits over all batches of the cohort", "gauge", "hit_rate"),
    ("dalid_cohort_lag_batches", "Batches the leading member is ahead", "gauge", "lag_batches"),
    ("dalid_cohort_held_bytes", "Output memory held for trailing members", "gauge", "held_bytes"),
    ("dalid_cohort_window_bytes", "The most held for trailing members", "gauge", "window_bytes"),
    ("dalid_cohort_leased_bytes", "Cohort memory tensors view", "gauge", "leased_bytes"),
    ("dalid_cohort_dropped", "Outputs dropped unserved", "counter", "dropped"),
    ("dalid_cohort_copied", "Runs copied into each member's own memory", "counter", "copied"),
    ("dalid_cohort_device_bytes", "GPU memory every member maps", "gauge", "device_bytes"),
    ("dalid_cohort_behind", "Members past the window, ranked behind", "gauge", "behind"),
    ("dalid_cohort_behind_runs", "Batches run for members behind", "counter", "behind_runs"),
)  # fmt: skip


class StatusCollector:
    """A Prometheus collector over the latest :class:`StatusReport` that ``snapshot`` returns."""

    def __init__(self, snapshot: Callable[[], StatusReport | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        report = self._snapshot()
        if report is None:
            return
        daemon = [report.device]
        for name, text, value in (
            ("dalid_jobs", "Jobs connected", len(report.jobs)),
            ("dalid_max_jobs", "Jobs the daemon accepts", report.max_jobs),
            ("dalid_concurrency", "Batches the daemon runs at once", report.concurrency),
            ("dalid_memory_reserved_bytes", "Output memory jobs reserved", report.memory_reserved),
            ("dalid_memory_limit_bytes", "Output memory jobs may reserve", report.memory_limit),
            ("dalid_uptime_seconds", "Seconds since the daemon started", report.uptime_seconds),
        ):
            gauge = GaugeMetricFamily(name, text, labels=["device"])
            gauge.add_metric(daemon, value)
            yield gauge
        labels = ["device", "job", "name"]
        for name, text, kind, field in JOB_METRICS:
            family = (
                CounterMetricFamily(name, text, labels=labels)
                if kind == "counter"
                else GaugeMetricFamily(name, text, labels=labels)
            )
            for job in report.jobs:
                value = getattr(job, field)
                if value is not None:
                    family.add_metric(_job_labels(report, job), float(value))
            yield family
        labels = ["device", "pipeline", "name", "shared"]
        for name, text, kind, field in PIPELINE_METRICS:
            family = (
                CounterMetricFamily(name, text, labels=labels)
                if kind == "counter"
                else GaugeMetricFamily(name, text, labels=labels)
            )
            for pipeline in report.pipelines:
                value = getattr(pipeline, field)
                family.add_metric(
                    [report.device, str(pipeline.pipeline), pipeline.name, str(pipeline.shared)],
                    float(len(value) if isinstance(value, tuple) else value),
                )
            yield family
        for name, text, kind, field in COHORT_METRICS:
            family = (
                CounterMetricFamily(name, text, labels=["device", "cohort"])
                if kind == "counter"
                else GaugeMetricFamily(name, text, labels=["device", "cohort"])
            )
            for cohort in report.cohorts:
                value = getattr(cohort, field)
                family.add_metric(
                    [report.device, cohort.name],
                    float(len(value) if isinstance(value, tuple) else value),
                )
            yield family


def _job_labels(report: StatusReport, job: JobStatus) -> list[str]:
    return [report.device, str(job.job_id), job.name]


class MetricsServer:
    """The HTTP endpoint's server and thread; ``close()`` stops both. Idempotent."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server: Any = server
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(5.0)


def serve_metrics(
    snapshot: Callable[[], StatusReport | None], host: str, port: int
) -> MetricsServer:
    """Starts the endpoint on ``host:port`` (port 0: any free port; see ``.port``)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise RuntimeError(
            "--metrics-port needs prometheus_client: pip install prometheus-client"
        ) from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(snapshot))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)
