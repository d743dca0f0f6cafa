"""The figures ``dalid status`` and the metrics endpoint show: per-job counters and rates."""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING

from dalid.protocol import JobStatus

from .scheduler import ShareStats

if TYPE_CHECKING:
    from .core import Job

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
    pools = [job.pool] if job.gpu_pool is None else [job.pool, job.gpu_pool]
    queued = sum(executor.queued for executor in job.pipelines.values())
    with job.lock:
        waiting = len(job.waiting)
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
        batches_per_second=batches_per_second,
        samples_per_second=samples_per_second,
        queued=queued,
        running=share.running,
        waiting=waiting,
        deferred=len(job.deferred),
        max_inflight_batches=job.limits.max_inflight_batches,
        slot_wait_seconds=share.waited_seconds,
        passed_over=share.passed_over,
        run_seconds=share.run_seconds,
        trainer_wait_seconds=job.trainer_waited,
        regions_held=sum(pool.leased_regions for pool in pools),
        bytes_held=sum(pool.leased_bytes for pool in pools),
        slabs=sum(pool.slab_count for pool in pools),
        memory_bytes=job.pool.limit_bytes,
        connected_seconds=now - job.connected_at,
    )
