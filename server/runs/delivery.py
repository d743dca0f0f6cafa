"""What a pipeline's run gives each of its batches: its rows of the outputs written into its own
job's memory (or, for a cohort's run, into the cohort's: Note [Cohort outputs] in cohorts.py),
its failure, or the outcome of its job's on_error policy after bad samples (``badsamples.py``),
each answered to its job and settled in its job's window."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence

from dalid.protocol import BadSample, BatchFailed, BatchReady, ErrorCode, OnError

from ..outputs.pool import PoolClosed, PoolFull
from ..outputs.run_output import OutputFailure, RunOutput
from ..pipelines.runner import PipelineRunner
from ..samples.badsamples import recover, summary
from ..samples.paths import unseen_file
from .cohorts import resubmit
from .run_planner import RunPlanner
from .runs import QUARANTINE_BATCHES, PendingBatch, Run

log = logging.getLogger("dalid.server")


class Delivery:
    """Delivers the runs of DALI pipeline ``instance_id`` to the jobs of ``planner``'s members.
    ``stream``: the stream DALI hands outputs over on (None: the host), and ``path_inputs``
    the inputs that are file paths, both known once the pipeline is built. Called from the
    pipeline's instance threads; a member's ``writing`` lock guards each write into its job's
    memory."""

    def __init__(self, instance_id: int, planner: RunPlanner, stopping: threading.Event) -> None:
        self.instance_id = instance_id
        self.stream: int | None = None
        self.path_inputs: tuple[str, ...] = ()
        self._planner = planner
        self._stopping = stopping

    def deliver(self, run: Run, outputs: Sequence[RunOutput]) -> None:
        """Each batch's rows of the run's outputs, into its own job's memory."""
        self._learn_sizes(outputs)
        for batch, rows in run.rows():
            member = batch.member
            assert member is not None
            if batch.cohort_entry is not None:
                self._deliver_to_cohort(batch, outputs, rows)
                continue
            with member.writing:
                if member.closed:
                    continue  # its job ended while the run was in DALI
                self._write(batch, outputs, rows)
                if member.quarantine:
                    member.quarantine -= 1

    def _deliver_to_cohort(
        self, batch: PendingBatch, outputs: Sequence[RunOutput], rows: range
    ) -> None:
        """A batch's rows of a run, for every member of its cohort waiting for the same inputs:
        into the cohort's memory, or else into each one's own (Note [Cohort outputs] in
        cohorts.py). Its own job may have ended: the others still get them."""
        entry = batch.cohort_entry
        assert entry is not None
        descriptors = entry.write(outputs, rows, self.stream)
        if descriptors is not None:
            settle = functools.partial(self._planner.settle, batch, released=True)
            own_copies = []
            for recipient, ready in entry.publish(descriptors, settle):
                member = recipient.member
                assert member is not None
                if ready is None:
                    own_copies.append(recipient)
                    continue
                member.answer(recipient, ready)
                if member.quarantine:
                    member.quarantine -= 1
            for recipient in own_copies:
                # Its trainer cannot map the cohort's GPU memory: its own copy, from the run,
                # once the members that share it have theirs (this may wait for its memory).
                member = recipient.member
                assert member is not None
                with member.writing:
                    if not member.closed:
                        self._write(recipient, outputs, rows)
            if batch.member is not None and batch.member.closed:
                self._planner.settle(batch)
            return
        for recipient in entry.take_recipients():
            member = recipient.member
            assert member is not None
            with member.writing:
                if not member.closed:
                    self._write(recipient, outputs, rows)

    def _abandon_cohort(self, batch: PendingBatch) -> None:
        """``batch`` ran for its cohort and failed or had bad samples: the members that waited
        for it run their own (Note [Cohort outputs] in cohorts.py)."""
        entry = batch.cohort_entry
        if entry is None:
            return
        batch.cohort_entry = None
        resubmit(entry.abandon())

    def _learn_sizes(self, outputs: Sequence[RunOutput]) -> None:
        sizes = []
        for output in outputs:
            if not output.samples:
                return
            device = "cuda" if type(output.tensors).__name__.endswith("GPU") else "cpu"
            sizes.append((device, output.row_bytes(output.whole)))
        self._planner.sample_sizes = sizes

    def _write(
        self,
        batch: PendingBatch,
        outputs: Sequence[RunOutput],
        rows: range,
        bad_samples: Sequence[BadSample] = (),
    ) -> None:
        member = batch.member
        assert member is not None
        copies: tuple[memoryview, ...] = ()
        try:
            try:
                descriptors, event = member.outputs.write_batch(
                    outputs,
                    rows,
                    source_stream=self.stream,
                    cancelled=lambda: self._stopping.is_set() or member.closed,
                    # Other jobs' batches wait for this run's end: no waiting for this job.
                    wait=len(self._planner.members) < 2,
                )
            except PoolFull:
                # Note [Private copies] in copies.py.
                descriptors, copies, event = member.outputs.private_copies(
                    outputs, rows, source_stream=self.stream
                )
        except OutputFailure as failure:
            self.fail(batch, failure.code, str(failure))
            return
        except PoolClosed:
            return  # the job ended while its outputs waited for room
        except Exception as error:
            # Whatever went wrong writing it, its trainer waits for an answer: it gets one.
            log.exception("pipeline %d: writing batch %d failed", self.instance_id, batch.batch_id)
            self.fail(batch, ErrorCode.INTERNAL_ERROR, f"its outputs could not be written: {error}")
            return
        # The regions are now leased to the trainer (Note [Output buffer lifetime]); the batch
        # leaves its job's window once they all come back, or now if it holds none.
        # (A private copy left on the device is taken at once: it is no part of the window.)
        leased = [d.region_id for d in descriptors if d.region_id and not d.copy]
        if leased:
            member.outputs.when_released(
                leased, functools.partial(self._planner.settle, batch, released=True)
            )
        member.answer(
            batch,
            BatchReady(
                batch.batch_id,
                member.pipeline_id,
                descriptors,
                retired_slabs=member.outputs.take_retired(),
                event=event,
                bad_samples=tuple(bad_samples),
                copies=copies,
            ),
        )
        if not leased:
            self._planner.settle(batch)

    def fail(
        self,
        batch: PendingBatch,
        code: ErrorCode,
        message: str,
        bad_samples: Sequence[BadSample] = (),
    ) -> None:
        """Answers ``batch`` with its failure."""
        member = batch.member
        assert member is not None
        self._abandon_cohort(batch)
        log.warning(
            "job %d pipeline %d batch %d failed (on DALI pipeline %d): %s",
            member.job_id,
            member.pipeline_id,
            batch.batch_id,
            self.instance_id,
            message,
        )
        member.answer(
            batch,
            BatchFailed(batch.batch_id, member.pipeline_id, code, message, tuple(bad_samples)),
        )
        self._planner.settle(batch)

    def recover(
        self,
        runner: PipelineRunner,
        batch: PendingBatch,
        code: ErrorCode,
        error: Exception | None,
        bad: dict[int, str],
    ) -> None:
        """Answers a batch that failed, or has ``bad`` samples, on the idle ``runner``, by its
        job's on_error policy (``badsamples.recover``); that job's next batches run alone."""
        member = batch.member
        assert member is not None
        self._abandon_cohort(batch)
        path_inputs = self.path_inputs
        if error is not None and path_inputs:
            # A file the daemon may not read, in a directory it enters, fails the run: checked
            # now, file by file (Note [Checking paths per directory] in paths.py).
            request = batch.request
            unseen = unseen_file(request.inputs, path_inputs, request.unreadable)
            if unseen:
                self.fail(batch, ErrorCode.INVALID_BATCH, unseen)
                return
        found = recover(
            runner,
            batch.arrays,
            size=batch.size,
            policy=member.on_error,
            failure=(code, error),
            bad=bad,
            stream=self.stream,
            path_inputs=path_inputs,
        )
        if found.report:
            # Another bad sample of this job then costs no other job a rerun.
            member.quarantine = QUARANTINE_BATCHES
        if found.outputs is None:
            self.fail(batch, found.code, found.message, found.report)
            return
        log.warning(
            "job %d pipeline %d batch %d (on DALI pipeline %d): %s %s",
            member.job_id,
            member.pipeline_id,
            batch.batch_id,
            self.instance_id,
            "skipped" if member.on_error is OnError.SKIP else "replaced",
            summary(found.report),
        )
        outputs = [RunOutput(i, output) for i, output in enumerate(found.outputs)]
        with member.writing:
            if not member.closed:
                self._write(batch, outputs, outputs[0].whole, found.report)
        del outputs, found
        runner.release()
