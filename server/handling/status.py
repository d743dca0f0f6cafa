"""The figures ``dalid status`` and the metrics endpoint show: the daemon, and per job its
counters and rates."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from dalid.protocol import PROTOCOL_VERSION, JobStatus, StatusReport, device_label

from ..runs.scheduler import ShareStats

if TYPE_CHECKING:
    from ..jobs.jobs import Job
    from ..jobs.quotas import Quotas
    from ..jobs.reservations import OutputMemory
    from ..runs.cohort_registry import Cohorts
    from ..runs.scheduler import FairScheduler
    from .registration import PipelineBuilder


class Daemon(Protocol):
    """What the report reads of the daemon (``core.DaemonCore``, which builds on this module
    and calls :func:`status_report` with itself)."""

    @property
    def device(self) -> str | int: ...
    @property
    def device_uuid(self) -> str: ...
    @property
    def dali_version(self) -> str: ...
    @property
    def quotas(self) -> Quotas: ...
    @property
    def scheduler(self) -> FairScheduler: ...
    @property
    def output_memory(self) -> Mapping[str, OutputMemory]: ...
    @property
    def jobs(self) -> Mapping[int, Job]: ...
    @property
    def pipelines(self) -> PipelineBuilder: ...
    @property
    def cohorts(self) -> Cohorts: ...


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
        workers_started=job.workers_started,
        pipelines=len(job.pipelines),
        batches_done=job.meter.batches,
        samples_done=job.meter.samples,
        batches_failed=job.batches_failed,
        batches_copied=job.batches_copied,
        batches_copied_on_device=job.batches_copied_on_device,
        copy_slab_bytes=job.outputs.copy_slab_bytes,
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


def status_report(core: Daemon, uptime: float) -> StatusReport:
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
