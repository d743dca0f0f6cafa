"""How jobs and connections end: a trainer gone, a worker gone, a job closed, the daemon stopping.

:class:`JobEndings` closes a job (its scheduler share, its cohorts, the batches still waiting
for acceptance) and keeps the output memory its trainer still maps until the trainer's process
exits; a worker that leaves takes its batches out of its job's window, and those it sent over the
job's limit fail. It owns no state of its own: it acts on the job registry, the scheduler and the
cohorts, from the I/O thread.
"""

from __future__ import annotations

import collections
import enum
import hmac
import logging

from dalid.protocol import (
    BATCH_IDS_PER_CONNECTION,
    BatchFailed,
    Error,
    ErrorCode,
    Role,
    SubmitBatch,
    WorkerLeft,
)

from ..jobs.jobs import Job, JobRegistry
from ..runs.cohort_registry import Cohorts
from ..runs.scheduler import FairScheduler
from .push import Push

log = logging.getLogger("dalid.server")

# Jobs ended to make room whose reason a worker that joins late is told (a few epochs' worth).
REASONS_REMEMBERED = 256


class Closing(enum.Enum):
    """Why a job closes, which says when its output memory may go."""

    # Its trainer said goodbye, exited or went silent: its memory goes once its pipelines
    # have stopped, and what the trainer still maps stays until its process exits.
    JOB_ENDED = enum.auto()
    # The daemon stops: every job's memory goes now, mapped or not.
    DAEMON_STOPS = enum.auto()


class JobEndings:
    """Ends the jobs of ``registry`` and its connections; ``push`` tells peers what they wait
    for in vain."""

    def __init__(
        self, registry: JobRegistry, scheduler: FairScheduler, cohorts: Cohorts, push: Push
    ) -> None:
        self._registry = registry
        self._scheduler = scheduler
        self._cohorts = cohorts
        self._push = push
        # Ended jobs whose pipelines' stops are under way: their outputs are closed after.
        self._stopping_jobs: list[Job] = []
        # Why idle jobs were ended, by job id, with their tokens: told to their workers.
        self._ended_why: collections.OrderedDict[int, tuple[str, str]] = collections.OrderedDict()

    def reap(self) -> list[int]:
        """Closes the jobs whose trainer process is gone; returns their ids."""
        for identity in self._registry.dead_workers():
            self.worker_left(identity)
            self._registry.forget_peer(identity)
        dead = self._registry.dead_jobs()
        for job in dead:
            log.info("job %d: trainer pid %d is gone, freeing what it held", job.job_id, job.pid)
            self.close_job(job)
        for job in self._registry.take_lingering():
            log.info(
                "job %d: trainer %d is gone, freeing the outputs it mapped", job.job_id, job.pid
            )
            job.outputs.free()
        stopped = [job for job in self._stopping_jobs if not job.stopping]
        for job in stopped:
            self._stopping_jobs.remove(job)
            self._close_outputs(job)
        self._cohorts.reap()
        return [job.job_id for job in dead]

    def close_job(self, job: Job, why: Closing = Closing.JOB_ENDED) -> None:
        self._registry.remove(job)
        share = self._scheduler.stats(job.job_id)
        log.info(
            "job %d (%s) ended: %d batches, %d samples, %d failed; its batches waited %.1f s "
            "for other jobs, passed over %d times",
            job.job_id,
            job.name or "?",
            job.meter.batches,
            job.meter.samples,
            job.batches_failed,
            share.waited_seconds,
            share.passed_over,
        )
        self._scheduler.remove_job(job.job_id)
        in_cohorts = [member for member in job.pipelines.values() if member.cohort is not None]
        waiting = job.close()
        for member in in_cohorts:
            self._cohorts.leave(member, job.pid, job.pid_namespace)
        for batch in waiting:
            # Its sender still waits for the acceptance; tell it why none comes.
            self._push(
                batch.sender,
                Error(
                    ErrorCode.UNKNOWN_JOB,
                    f"job {job.job_id} ended before its batch was accepted",
                    op=SubmitBatch.OP,
                ),
                batch.request_id,
            )
        if job.stopping and why is Closing.JOB_ENDED:
            # Its outputs close once its pipelines have stopped (Note [A pipeline stuck inside
            # DALI] in runs/stopping.py): looked at each reap.
            self._stopping_jobs.append(job)
            return
        self._close_outputs(job, why)

    def end_idle(self, job: Job, why: str) -> None:
        """Ends an idle job to make room for a new one (reclaim.py), telling its trainer and
        workers ``why``: an ``unknown_job`` notice with ``ends_jobs`` (SPEC.md, "Liveness"),
        which their clients raise as ``JobEnded`` at their next call; a worker that joins
        later is refused with it."""
        notice = Error(ErrorCode.UNKNOWN_JOB, why, ends_jobs=True)
        for identity in job.peers:
            self._push(identity, notice, None)
        self._ended_why[job.job_id] = (job.token, why)
        if len(self._ended_why) > REASONS_REMEMBERED:
            self._ended_why.popitem(last=False)
        self.close_job(job)

    def ended_why(self, job_id: int, token: str) -> str:
        """Why job ``job_id`` (with ``token``) was ended to make room, "" if it was not."""
        token_and_why = self._ended_why.get(job_id)
        if token_and_why is None or not hmac.compare_digest(
            token_and_why[0].encode(), token.encode()
        ):
            return ""
        return token_and_why[1]

    def _close_outputs(self, job: Job, why: Closing = Closing.JOB_ENDED) -> None:
        kept = job.close_outputs() and why is Closing.JOB_ENDED
        if kept and self._registry.alive(job.pid, job.pid_namespace):
            # Tensors of the trainer still view some of the job's memory, which CUDA forbids
            # freeing before it unmaps it; its process exit does (Note [GPU output lifetime]).
            log.info("job %d: keeping the outputs its trainer still maps until pid %d exits",
                     job.job_id, job.pid)  # fmt: skip
            self._registry.linger(job)
        else:
            job.outputs.free()

    def trainer_unreachable(self, identity: bytes) -> None:
        peer = self._registry.peers.get(identity)
        if peer is not None and peer.role is Role.TRAINER:
            log.info("job %d: trainer disconnected", peer.job.job_id)
            self.close_job(peer.job)

    def peer_disconnected(self, identity: bytes) -> None:
        """The connection of ``identity`` closed or stopped answering heartbeats.

        A trainer's ends its job; a worker's takes with it the batches it sent over the job's
        limit, which fail (the trainer may wait for them).
        """
        peer = self._registry.peers.get(identity)
        if peer is None:
            return
        if peer.role is Role.TRAINER:
            log.info(
                "job %d: the trainer's connection closed, freeing what it held", peer.job.job_id
            )
            self.close_job(peer.job)
            return
        job = peer.job
        self.worker_left(identity)
        dropped = job.admission.drop_sender(identity)
        if dropped:
            log.info("job %d: a worker left; dropped %d batches it sent", job.job_id, len(dropped))
        for waiting in dropped:
            # Its worker handed the batch on already: the trainer may wait for it.
            job.batches_failed += 1
            batch = waiting.batch
            self._push(
                job.trainer,
                BatchFailed(
                    batch.batch_id,
                    batch.request.pipeline_id,
                    ErrorCode.UNKNOWN_BATCH,
                    f"batch {batch.batch_id} was dropped: the connection of the worker that sent "
                    "it closed while the batch waited for its turn",
                ),
                None,
            )
        self._registry.forget_peer(identity)

    def worker_left(self, identity: bytes) -> None:
        """A worker's connection is gone: its batches leave its job's window (Note [A job's
        window] in run_planner.py), since the trainer asks for none of them after that."""
        peer = self._registry.peers.get(identity)
        if peer is None or peer.role is Role.TRAINER:
            return
        first, end = peer.batch_ids.base, peer.batch_ids.base + BATCH_IDS_PER_CONNECTION
        job = peer.job
        for member in job.pipelines.values():
            if member.executor is not None:
                member.executor.sender_left(member, first, end)
            if member.cohort is not None:
                member.cohort.sender_left(job.job_id, first, end)
        if job.trainer in self._registry.peers:
            # Its results the trainer has not asked for wait there unclaimed otherwise.
            self._push(job.trainer, WorkerLeft(first, end), None)

    def close_all(self) -> None:
        """The daemon stops: every job ends, and the memory trainers still map is freed."""
        for job in list(self._registry.jobs.values()):
            self.close_job(job, Closing.DAEMON_STOPS)
        for job in self._stopping_jobs:
            self._close_outputs(job, Closing.DAEMON_STOPS)
        self._stopping_jobs.clear()
        for job in self._registry.take_lingering(everything=True):
            job.outputs.free()
