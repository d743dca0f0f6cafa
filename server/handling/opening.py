"""Opening a job: a trainer's hello granted within the daemon's quotas, and output memory for jobs
and cohorts, reserved per kind of memory against the daemon's limits.

:class:`JobOpening` owns what jobs reserve of output memory (``output_memory``, by the device of
their stores); the core asks it to open a job for a trainer's hello and to make a cohort's memory.
"""

from __future__ import annotations

import logging

from dalid.protocol import ErrorCode, Hello, Limits

from ..errors import RequestRefused
from ..jobs.inputs import InputMemory
from ..jobs.jobs import Job, JobRegistry, job_label
from ..jobs.quotas import QuotaRefused, Quotas, grant
from ..jobs.reservations import OutputMemory
from ..outputs.copies import PRIVATE_COPY_AFTER_S
from ..outputs.job_outputs import JobOutputs, OutputsFactory
from ..runs.scheduler import FairScheduler
from .reclaiming import IdleReclaim

log = logging.getLogger("dalid.server")


class JobOpening:
    """Opens the jobs of ``registry`` within ``quotas``, each with output stores made by
    ``outputs`` (slabs named after ``prefix``), and makes cohorts' output memory. Called from
    the I/O thread. ``reclaiming`` ends a job idle long enough to make room for a newcomer
    (reclaiming.py; by default none)."""

    def __init__(
        self,
        registry: JobRegistry,
        quotas: Quotas,
        inputs: InputMemory,
        scheduler: FairScheduler,
        *,
        outputs: OutputsFactory,
        prefix: str,
        reclaiming: IdleReclaim | None = None,
    ) -> None:
        self._reclaiming = reclaiming or IdleReclaim(registry, 0.0, None)
        self._registry = registry
        self._quotas = quotas
        self._inputs = inputs
        self._scheduler = scheduler
        self._outputs = outputs
        self._prefix = prefix
        # What jobs reserve of output memory, by the device of their stores: shared memory
        # against --memory-limit, device memory the same way with no limit of its own.
        self.output_memory = {"cpu": OutputMemory(quotas.memory_limit), "cuda": OutputMemory(0)}

    def open(self, identity: bytes, hello: Hello, pid: int, uid: int = -1) -> Job:
        """A new job for a trainer's hello, within the daemon's quotas; ``pid``: its trainer's
        process, 0 where the daemon cannot see it; ``uid``: its user, -1 where unknown.

        Its output memory is reserved now if the job asked for an amount, else as its outputs
        need it, up to ``limits.pool_bytes`` (:mod:`dalid.server.jobs.reservations`).
        """
        self._registry.check_unclaimed(hello.earlier_jobs)
        try:
            try:
                limits = self._grant(hello, pid, uid)
            except QuotaRefused as refusal:
                if refusal.full is None or not self._reclaim(refusal, uid):
                    raise
                limits = self._grant(hello, pid, uid)
            reservations = {
                device: memory.fixed(limits.pool_bytes)
                if hello.memory_bytes
                else memory.growing(limits.pool_bytes)
                for device, memory in self.output_memory.items()
            }
        except QuotaRefused as refusal:
            raise RequestRefused(ErrorCode.RESOURCE_EXHAUSTED, self._refused(refusal)) from None
        try:
            job = self._registry.open(
                identity,
                hello,
                limits,
                lambda job_id: self._outputs(f"{self._prefix}-j{job_id}", limits),
                self._quotas.max_waiting_batches,
                pid=pid,
                uid=uid,
            )
        except BaseException:
            for reservation in reservations.values():
                reservation.close()
            raise
        # Each store's pool owns its reservation from here (it closes it when it closes).
        for store in job.outputs.stores:
            store.pool.grow_within(reservations.pop(store.device))
        for unused in reservations.values():
            unused.close()
        self._scheduler.add_job(job.job_id, limits.weight)
        if hello.private_copies:
            job.outputs.copy_after = PRIVATE_COPY_AFTER_S
            job.outputs.copies.device_copies = hello.device_copies
        log.info(
            "job %d (%s) connected: weight %g, %s MiB of output memory, %d batches in flight%s",
            job.job_id,
            job_label(hello.name, pid),
            limits.weight,
            ("" if hello.memory_bytes else "up to ") + str(limits.pool_bytes >> 20),
            limits.max_inflight_batches,
            f"; it was job {', '.join(str(e.job_id) for e in hello.earlier_jobs)} of earlier "
            "daemons"
            if hello.earlier_jobs
            else "",
        )
        return job

    def _grant(self, hello: Hello, pid: int, uid: int) -> Limits:
        jobs = self._registry.jobs
        return grant(
            hello,
            self._quotas,
            jobs=len(jobs),
            max_message_bytes=self._inputs.job_limit,
            pid=pid,
            jobs_of_process=sum(1 for job in jobs.values() if job.pid == pid),
            uid=uid,
            jobs_of_user=sum(1 for job in jobs.values() if job.uid == uid),
        )

    def _reclaim(self, refusal: QuotaRefused, uid: int) -> bool:
        """Ends the job idle longest that a newcomer of ``uid`` competes with under the limit
        that refused it, if one has been idle long enough (reclaim.py); whether one was."""
        if refusal.full is None:
            return False
        return self._reclaiming.end_for(refusal.full, refusal.what, uid=uid, newcomer="a new job")

    def _refused(self, refusal: QuotaRefused) -> str:
        """A refusal's message; one of a full limit of jobs says that no job was idle long
        enough to be ended for the newcomer."""
        if refusal.full is None:
            return str(refusal)
        return self._reclaiming.refused(str(refusal))

    def cohort_outputs(self, name_prefix: str, limits: Limits) -> JobOutputs:
        """A cohort's output memory, of the kinds a job's is (shared memory; on a GPU daemon,
        device memory too, whose regions every member maps: cohorts.py), each reserved as it
        grows as a job's is (shared memory against the daemon's --memory-limit)."""
        outputs = self._outputs(name_prefix, limits)
        try:
            for store in outputs.stores:
                store.pool.grow_within(self.output_memory[store.device].growing(limits.pool_bytes))
        except QuotaRefused as refusal:
            outputs.close()
            outputs.free()
            raise RequestRefused(ErrorCode.RESOURCE_EXHAUSTED, str(refusal)) from None
        # A cohort's run never waits for a member's trainer: with no room, it goes to each
        # member's own memory instead (Note [Cohort outputs] in cohorts.py).
        outputs.copy_after = 0.0
        return outputs
