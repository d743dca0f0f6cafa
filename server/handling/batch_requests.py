"""The daemon's handlers of a job's pipelines and batches: a pipeline's registration, a batch's
submission and scheduling, the release of its output regions, and the delivery of its result.

:class:`BatchRequests` holds them for the daemon core (``core.py``), whose table dispatches
these requests here once the connection has said hello. What they act on lives in modules of
its own: jobs and peers (``jobs.py``), a job's batches in flight (``admission.py``), the batch
inputs held (``inputs.py``), its output memory (``job_outputs.py``) and the pipelines' executors
(``registration.py``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Hashable, Sequence

from dalid.protocol import (
    BatchAccepted,
    BatchFailed,
    BatchReady,
    ErrorCode,
    Message,
    Ok,
    RegisterNamedPipeline,
    RegisterPipeline,
    ReleaseRegions,
    Role,
    ScheduleBatch,
    SubmitBatch,
    WantBatch,
)

from ..errors import RequestRefused
from ..jobs.inputs import InputMemory, InputRefused
from ..jobs.jobs import Job, JobRegistry, Peer
from ..jobs.quotas import Quotas
from ..outputs.job_outputs import JobOutputs
from ..outputs.store import ReleaseRefused
from ..runs.cohort_registry import Cohorts
from ..runs.cohorts import COHORT_REGION_BASE, Outcome
from ..runs.runs import PendingBatch
from .budget import BudgetFull
from .members import check_batch, executor_for
from .push import Push
from .reclaiming import IdleReclaim, pipelines_held
from .registration import PipelineBuilder

log = logging.getLogger("dalid.server")


class BatchRequests:
    """Handles the requests of a job's pipelines and batches, for a connection that is in a
    job (the core checks that). ``push(peer, message)`` must be thread-safe."""

    def __init__(
        self,
        registry: JobRegistry,
        quotas: Quotas,
        pipelines: PipelineBuilder,
        inputs: InputMemory,
        push: Push,
        *,
        cohorts: Cohorts | None = None,
        prefix: str = "dalid",
        reclaiming: IdleReclaim | None = None,
    ) -> None:
        # Ends an idle job for a new pipeline that a full limit refuses (reclaiming.py; by
        # default none).
        self.reclaiming = reclaiming or IdleReclaim(registry, 0.0, None)
        # The cohorts jobs join by name, whose output slabs are named after ``prefix``.
        self.cohorts = cohorts if cohorts is not None else Cohorts(_no_outputs, 0, _alive)
        self.prefix = prefix
        self.registry = registry
        self.quotas = quotas
        self.pipelines = pipelines
        self.inputs = inputs
        self._push = push

    @property
    def peers(self) -> dict[bytes, Peer]:
        return self.registry.peers

    def on_register_pipeline(
        self,
        identity: bytes,
        request: RegisterPipeline | RegisterNamedPipeline,
        request_id: int | None,
    ) -> Message | None:
        peer = self.peers[identity]
        if peer.role is not Role.TRAINER:
            raise RequestRefused(ErrorCode.NOT_WELCOMED, "only a trainer registers pipelines")
        live = sum(1 for member in peer.job.pipelines.values() if not member.failed)
        if live >= self.quotas.max_pipelines:
            raise RequestRefused(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"job {peer.job.job_id} already has {live} pipelines, the limit of one job (dalid "
                f"serve --max-pipelines {self.quotas.max_pipelines}): a job registers each "
                "pipeline once",
            )
        peer.job.check_earlier_ids(request)
        job = peer.job
        job.active_at = time.monotonic()
        cohort_key: list[Hashable] = []
        check = None
        if request.cohort:
            # Refused before anything starts if it cannot join (cohorts.py).
            def check(key: Hashable) -> None:
                self.cohorts.check(request.cohort, key, request.deterministic, job.job_id)
                cohort_key.append(key)

        start = functools.partial(
            self.pipelines.start,
            job,
            request,
            request_id,
            functools.partial(self._batch_answered, job),
            check=check,
        )
        try:
            member = start()
        except BudgetFull as full:
            if not self._reclaim(job, full):
                raise RequestRefused(full.code, self.reclaiming.refused(str(full))) from None
            cohort_key.clear()
            member = start()  # once: the job ended freed a pipeline and its threads
        if cohort_key:
            self.cohorts.join(request.cohort, cohort_key[0], member, job.limits, self.prefix)
        return None  # answered once the pipeline is built

    def _reclaim(self, job: Job, full: BudgetFull) -> bool:
        """Ends the job idle longest that ``job``'s new pipeline competes with under the limit
        that refused it (reclaim.py), whose end frees what it holds of that limit; whether one
        was."""
        holds = pipelines_held(self.pipelines.budget, full.holding, full.full)
        newcomer = f"another job's pipeline (job {job.job_id})"
        return self.reclaiming.end_for(
            full.full, full.what, uid=job.uid, newcomer=newcomer, holds=holds, asking=job
        )

    def on_submit_batch(
        self, identity: bytes, request: SubmitBatch, request_id: int | None
    ) -> Message | None:
        """Takes a batch under the id its sender chose (batch_ids.py).

        The sender has handed the batch on without waiting (SPEC.md, "Submitting a batch"), so
        a refusal of a batch with a valid id is its result: ``batch_failed``, answered to the
        sender and pushed to the trainer, which raises it when it reaches the batch. A deferred
        batch's sender waits for the answer (the trainer can only schedule a batch the daemon
        holds) and gets an ``error``, as does a submission whose id is refused.
        """
        peer = self.peers[identity]
        peer.job.active_at = time.monotonic()  # what idle means: reclaim.py
        peer.batch_ids.take(request.batch_id)
        try:
            return self._submit(peer, request, request_id)
        except RequestRefused as refusal:
            if request.deferred:
                raise
            job = peer.job
            job.batches_failed += 1
            failed = BatchFailed(request.batch_id, request.pipeline_id, refusal.code, str(refusal))
            if identity != job.trainer:
                self._push(job.trainer, failed, None)
            return failed

    def _submit(self, peer: Peer, request: SubmitBatch, request_id: int | None) -> Message | None:
        job = peer.job
        if peer.earlier_token:
            request = job.pipeline_in_this_job(peer.earlier_token, request)
        member = executor_for(job, request.pipeline_id)
        check_batch(member, request)
        if request.deferred and len(job.deferred) >= self.quotas.max_waiting_batches:
            raise RequestRefused(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"job {job.job_id} already has {len(job.deferred)} deferred batches: schedule "
                "them before sending more",
            )
        batch = PendingBatch(request.batch_id, request, member)
        nbytes = sum(item.nbytes for item in request.inputs)
        try:
            # Counted until the batch is freed, whichever way it goes (inputs.py).
            batch.give_back_inputs = self.inputs.take(job.job_id, nbytes, holder=batch)
        except InputRefused as refusal:
            raise RequestRefused(ErrorCode.RESOURCE_EXHAUSTED, str(refusal)) from None
        if member.cohort is not None and not request.deferred:
            # Served from another member's run of the same inputs, now or when it ends, the
            # batch takes none of the job's turns (Note [Cohort outputs] in cohorts.py).
            outcome, ready = member.cohort.take(batch)
            if ready is not None:
                member.answer(batch, ready)
            if outcome not in (Outcome.RUN, Outcome.ALONE):
                return BatchAccepted(batch.batch_id)
        if request.deferred:
            # A deferred batch takes no turn until the trainer schedules it, and a limit here
            # could hold back the very batch the trainer waits for.
            job.deferred[batch.batch_id] = batch
            return BatchAccepted(batch.batch_id)
        assert member.executor is not None
        if job.admission.submit(batch, member.executor, peer.identity, request_id):
            return BatchAccepted(batch.batch_id)
        return None  # backpressure: answered once an earlier batch of the job is answered

    def _batch_answered(
        self, job: Job, batch: PendingBatch, result: BatchReady | BatchFailed
    ) -> None:
        """Delivers a batch's result and lets the job's next waiting batch in.

        Runs in the executor's thread.
        """
        if isinstance(result, BatchFailed):
            job.batches_failed += 1
        else:
            if result.copied:
                job.batches_copied += 1
                job.batches_copied_on_device += any(output.copy for output in result.outputs)
                if job.batches_copied == 1:
                    log.warning(
                        "job %d: its trainer holds all %d MiB of its output memory (it keeps "
                        "its outputs), so batches that find no room come as private copies, "
                        "which is slower; to avoid it, keep copies of kept outputs "
                        "(tensor.clone()) or connect with a larger memory_bytes",
                        job.job_id,
                        job.limits.pool_bytes >> 20,
                    )
            # Skipped bad samples are not delivered; replaced ones are, as their stand-ins.
            skipped = sum(1 for bad in result.bad_samples if bad.replaced_by < 0)
            job.meter.add(batch.request.batch_size - skipped)
        batch.drop_samples()
        job.active_at = time.monotonic()
        self._push(job.trainer, result, None)
        admitted = job.admission.answered(batch)
        if admitted is not None:
            self._push(admitted.sender, BatchAccepted(admitted.batch.batch_id), admitted.request_id)

    def on_schedule_batch(
        self, identity: bytes, request: ScheduleBatch, _request_id: int | None
    ) -> Message:
        job = self.peers[identity].job
        job.active_at = time.monotonic()
        batch = job.deferred.pop(request.batch_id, None)
        if batch is None:
            raise RequestRefused(
                ErrorCode.UNKNOWN_BATCH, f"batch {request.batch_id} is not waiting to be scheduled"
            )
        member = executor_for(job, batch.request.pipeline_id)
        assert member.executor is not None
        member.executor.submit(batch)
        return Ok()

    def on_want_batch(self, identity: bytes, request: WantBatch, _request_id: int | None) -> None:
        """The trainer waits for a batch: each of the job's pipelines moves it to the front if
        it has it queued, or when it comes (Note [A job's window] in run_planner.py), and one
        held back by the job's in-flight limit comes now. A want for a batch the job does not
        hold changes nothing; none is answered."""
        self._want(self.peers[identity].job, request.batch_id)

    def _want(self, job: Job, batch_id: int) -> None:
        job.active_at = time.monotonic()
        for member in job.pipelines.values():
            if member.executor is not None:
                member.executor.want(member, batch_id)
            if member.cohort is not None:
                # Parked for room in the job's window, it passes it (Note [Cohort outputs]).
                member.cohort.want(job.job_id, batch_id)
        admitted = job.admission.want(batch_id)
        if admitted is not None:
            self._push(admitted.sender, BatchAccepted(admitted.batch.batch_id), admitted.request_id)

    def on_release_regions(
        self, identity: bytes, request: ReleaseRegions, _request_id: int | None
    ) -> Message | None:
        """The trainer's tensors of these regions died; a ``want_batch`` it carries is taken
        after them, as its own message sent next would have been, even if they are refused,
        and so is the progress report it carries."""
        job = self.peers[identity].job
        job.active_at = time.monotonic()
        if request.progress is not None:
            job.trainer_waited = request.progress.waited_seconds
        try:
            self._release(job, request)
        finally:
            if request.want_batch is not None:
                self._want(job, request.want_batch)
        return None

    def _release(self, job: Job, request: ReleaseRegions) -> None:
        region_ids: Sequence[int] = request.region_ids
        try:
            fence = request.event
            if request.closed_slabs or any(r >= COHORT_REGION_BASE for r in region_ids):
                region_ids = self._release_cohort_regions(job, request)
                if not any(r < COHORT_REGION_BASE for r in region_ids):
                    # The fence was for the cohort's regions only: the job's own stream need
                    # not wait for the trainer's work.
                    fence = ""
            unknown = job.outputs.release(region_ids, fence, request.closed_slabs)
        except ReleaseRefused as refusal:
            raise RequestRefused(ErrorCode.MALFORMED_MESSAGE, f"{request.OP}: {refusal}") from None
        if unknown:
            raise RequestRefused(
                ErrorCode.UNKNOWN_REGION,
                f"regions {unknown[:8]} are not leased to job {job.job_id}",
            )

    def _release_cohort_regions(self, job: Job, request: ReleaseRegions) -> list[int]:
        """Ends the job's leases of its cohorts' regions among the request's, after its fence
        (GPU regions), and hands its cohorts the slabs it reports unmapped; the job's own ids,
        and those no cohort leased to it (refused with them), are left."""
        region_ids = request.region_ids
        own = [region_id for region_id in region_ids if region_id < COHORT_REGION_BASE]
        shared = [region_id for region_id in region_ids if region_id >= COHORT_REGION_BASE]
        for cohort in {id(m.cohort): m.cohort for m in job.pipelines.values() if m.cohort}.values():
            shared = cohort.release(job.job_id, shared, request.event, request.closed_slabs)
        return own + shared


def _no_outputs(prefix: str, limits: object) -> JobOutputs:
    raise RequestRefused(ErrorCode.INVALID_PIPELINE, "this daemon has no memory for cohorts")


def _alive(pid: int, namespace: int) -> bool:
    return True
