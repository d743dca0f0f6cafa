"""The figures ``dalid status`` and the metrics endpoint show: per-job counters and rates."""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import TYPE_CHECKING

from dalid.protocol import PROTOCOL_VERSION, JobStatus, StatusReport, device_label

from .scheduler import ShareStats

if TYPE_CHECKING:
    from .core import DaemonCore
    from .jobs import Job

# Rates are averaged over this many seconds: long enough to smooth batch-sized steps, short
# enough that a live table follows a job that slows down.
RATE_WINDOW_S = 5.0


class RateMeter:
    """Batches and samples delivered: totals, and rates over the last ``window`` seconds.

    Executor threads add; the daemon's I/O thread reads.
    """

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self.batches = 0
        self.samples = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        self._since = time.monotonic()

    def add(self, samples: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.batches += 1
            self.samples += samples
            self._recent.append((now, samples))
            self._forget_before(now - self.window)

    def rates(self, now: float | None = None) -> tuple[float, float]:
        """Batches and samples per second over the window (or since the meter started)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._forget_before(now - self.window)
            span = min(self.window, now - self._since)
            if span <= 0 or not self._recent:
                return 0.0, 0.0
            samples = sum(count for _, count in self._recent)
            return len(self._recent) / span, samples / span

    def _forget_before(self, cutoff: float) -> None:
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()


def job_status(job: Job, share: ShareStats, now: float) -> JobStatus:
    """One job's line of the status report; called on the daemon's I/O thread."""
    batches_per_second, samples_per_second = job.meter.rates(now)
    queued = sum(member.queued for member in job.pipelines.values())
    return JobStatus(
        job_id=job.job_id,
        name=job.name,
        pid=job.pid,
        weight=job.limits.weight,
        workers=sum(1 for peer in job.peers if peer != job.trainer),
        pipelines=len(job.pipelines),
        batches_done=job.meter.batches,
        samples_done=job.meter.samples,
        batches_failed=job.batches_failed,
        batches_copied=job.batches_copied,
        batches_per_second=batches_per_second,
        samples_per_second=samples_per_second,
        queued=queued,
        running=share.running,
        waiting=job.admission.waiting,
        deferred=len(job.deferred),
        max_inflight_batches=job.limits.max_inflight_batches,
        slot_wait_seconds=share.waited_seconds,
        passed_over=share.passed_over,
        run_seconds=share.run_seconds,
        trainer_wait_seconds=job.trainer_waited,
        regions_held=job.outputs.leased_regions,
        bytes_held=job.outputs.leased_bytes,
        slabs=job.outputs.slab_count,
        slab_bytes=job.outputs.slab_bytes,
        peak_slab_bytes=job.outputs.peak_slab_bytes,
        memory_bytes=job.outputs.store("cpu").pool.limit_bytes,
        connected_seconds=now - job.connected_at,
        output_path=job.outputs.path,
    )


def status_report(core: DaemonCore, uptime: float) -> StatusReport:
    """The daemon and its jobs now, as ``dalid status`` and the metrics endpoint show them."""
    now = time.monotonic()
    return StatusReport(
        daemon_pid=os.getpid(),
        device=device_label(core.device),
        device_uuid=core.device_uuid,
        dali_version=core.dali_version,
        protocol_version=PROTOCOL_VERSION,
        uptime_seconds=uptime,
        max_jobs=core.quotas.max_jobs,
        concurrency=core.scheduler.slots,
        memory_limit=core.quotas.memory_limit,
        memory_reserved=core.output_memory["cpu"].reserved,
        jobs=tuple(
            job_status(job, core.scheduler.stats(job.job_id), now) for job in core.jobs.values()
        ),
        pipelines=core.pipelines.status(),
        cohorts=core.cohorts.status(),
    )
