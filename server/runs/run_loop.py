"""The runs of one DALI instance of a pipeline, in its thread: it keeps up to the pipeline's
``prefetch_queue_depth`` runs inside DALI, so that decoding of the next run overlaps the copy-out
of the previous one, and hands each run that comes out to its delivery.

A run that fails kills the DALI pipeline: the loop rebuilds it and runs the batches that were
inside it again, those of a mixed run that failed one by one, so that a bad sample of one job
never fails or skips another job's samples; a batch that fails alone is answered by its job's
on_error policy (``Delivery.recover``). One that cannot be rebuilt fails its own batches and
ends, and the pipeline stops working only when its last instance does.

Each run passes the daemon's :class:`RunGate` on its way into DALI and back: a pipeline on
probation after a crash (``solo``) has its runs in DALI alone (``run_gate.py``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Protocol

from dalid.protocol import ErrorCode

from ..outputs.run_output import RunOutput
from ..pipelines.runner import PipelineRunner
from .dali_instances import DaliInstances, Instance
from .delivery import Delivery
from .run_gate import RunGate
from .run_planner import RunPlanner
from .runs import PendingBatch, Run
from .scheduler import ServiceClock

log = logging.getLogger("dalid.server")


class Pipeline(Protocol):
    """The pipeline whose instance the loop runs (``executor.PipelineExecutor``), as the loop
    uses it."""

    instance_id: int
    failed: bool
    planner: RunPlanner
    delivery: Delivery
    instances: DaliInstances
    clock: ServiceClock
    stopping: threading.Event
    # The daemon's gate into DALI, and whether this pipeline's runs go in alone (probation).
    gate: RunGate
    solo: bool

    def look(self) -> None: ...

    def account(self, run: Run) -> None: ...

    def ran_solo(self) -> None: ...


class RunLoop:
    """The runs of ``instance`` of ``executor``'s pipeline, on its built ``runner``: those in
    DALI (each holding a slot of the scheduler, taken before DALI gets it and given back once
    DALI is done with it) and the batches to run again after a failure, first."""

    def __init__(self, executor: Pipeline, instance: Instance, runner: PipelineRunner) -> None:
        self._executor = executor
        self._planner = executor.planner
        self._delivery = executor.delivery
        self._stopping = executor.stopping
        self._instance = instance
        self._runner = runner
        self._depth = runner.spec.prefetch_queue_depth
        self._in_flight: collections.deque[Run] = collections.deque()
        self._retry: collections.deque[PendingBatch] = collections.deque()
        # A run formed while the gate was closed to it: it goes first once the gate opens.
        self._held: Run | None = None
        # Whether the runs in DALI went in solo (``executor.solo`` may change between runs).
        self._solo = False
        # Runs still to go into DALI one at a time, so that a failure is their own (Note [A
        # failure under the legacy executor]).
        self._one_at_a_time = 0

    def run(self) -> None:
        """Runs batches until the instance is dropped (and its own runs are done) or the
        pipeline stops; then gives back what it holds of the scheduler."""
        try:
            while not self._stopping.is_set():
                self._executor.look()
                if (
                    self._instance.retiring
                    and not self._retry
                    and not self._in_flight
                    and self._held is None
                ):
                    break  # dropped, and its own runs are done
                self._fill()
                if self._stopping.is_set() or not self._in_flight:
                    continue
                self._collect()
        except Exception as error:
            self._stopped_working(error)
        finally:
            self._leave(len(self._in_flight))
            others = self._executor.instances.others_running(self._instance)
            self._planner.give_up(last=not others or self._stopping.is_set())

    def _fill(self) -> None:
        """Schedules runs into DALI up to its depth (waiting for one only when DALI holds
        none): batches to run again first, then new ones unless the instance is retiring."""
        depth = 1 if self._one_at_a_time else self._depth
        while len(self._in_flight) < depth and (
            self._held is not None or self._retry or not self._instance.retiring
        ):
            run, self._held = self._held, None
            if run is None:
                run = self._planner.next_run(self._retry, block=not self._in_flight)
            if run is None:
                return
            scheduled = self._schedule(run)
            if scheduled is None:
                return
            if scheduled:
                self._in_flight.append(run)

    def _enter(self, run: Run) -> bool:
        """Takes the gate for ``run``: at once while runs of this instance are in DALI (else
        ``run`` is held until they come out), waiting while none are. False: not now."""
        solo = self._executor.solo
        if self._in_flight and solo != self._solo:
            self._held = run  # solo and ordinary runs of one instance are not in DALI together
            return False
        if self._executor.gate.enter(solo, wait=not self._in_flight, stopping=self._stopping):
            self._solo = solo
            return True
        if self._in_flight:
            self._held = run
        else:  # stopping while it waited: its batches stay this instance's to answer
            self._planner.give_slots(1)
            self._retry.extendleft(reversed(run.batches))
        return False

    def _leave(self, runs: int = 1) -> None:
        for _ in range(runs):
            self._executor.gate.leave(self._solo)

    def _schedule(self, run: Run) -> bool | None:
        """Puts ``run`` into DALI; False where it could not go (its slot given back, its
        batches answered or to run again), None where it waits for the gate (``_held``)."""
        first = run.batches[0]
        if first.refused:
            # Not a bad sample: the batch as a whole cannot run (see paths.py, sizes.py).
            self._planner.give_slots(1)
            self._delivery.fail(first, ErrorCode.INVALID_BATCH, first.refused)
            return False
        if first.oversized:
            self._failed(run, ErrorCode.INVALID_BATCH, None)
            return False
        if not self._enter(run):
            return None
        try:
            run.entered = time.monotonic()
            self._runner.schedule(run.arrays())
        except Exception as error:
            self._leave()
            self._failed(run, ErrorCode.INVALID_BATCH, error)
            return False
        return True

    def _collect(self) -> None:
        """Takes the oldest run out of DALI and delivers it."""
        run = self._in_flight.popleft()
        try:
            outputs = self._runner.collect(self._delivery.stream)
        except Exception as error:
            self._leave()
            self._failed(run, ErrorCode.PIPELINE_ERROR, error)
            return
        self._leave()
        if self._one_at_a_time:
            self._one_at_a_time -= 1
        if self._solo:
            self._executor.ran_solo()
        self._executor.account(run)
        self._instance.runs += 1
        self._instance.samples += run.samples
        self._planner.give_slots(1, self._retry)
        self._delivery.deliver(run, [RunOutput(i, output) for i, output in enumerate(outputs)])
        del outputs
        self._runner.release()

    def _failed(self, run: Run, code: ErrorCode, error: Exception | None) -> None:
        """``run`` failed, or will (``error`` None: it has samples known bad): its slot goes
        back, and the instance starts over.

        After a failure the DALI pipeline is dead, and looking for bad samples needs an idle
        one: rebuild, then run again the runs that were inside the old pipeline, in their
        order (they take their slots anew). The batches of a failed mixed run go first, each
        alone; a batch that fails alone is answered now."""
        self._planner.give_slots(1)
        self._planner.give_slots(len(self._in_flight))
        self._leave(len(self._in_flight))
        # Note [A failure under the legacy executor]
        # ------------------------------------------
        # DALI's legacy executor raises a run's failure at the next collect, whichever run in
        # DALI failed: with others in DALI, the failure may not be this run's. Then none is
        # answered: they all go again, one at a time, so that the failure of each is its own
        # (docs/design/host-buffers.md).
        unknown = error is not None and bool(self._in_flight) and not self._runner.dynamic
        if unknown:
            self._one_at_a_time = 1 + len(self._in_flight)
            self._in_flight.appendleft(run)
        if self._held is not None:  # formed after those in DALI: it runs again after them
            self._planner.give_slots(1)
            self._retry.extendleft(reversed(self._held.batches))
            self._held = None
        self._retry.extendleft(reversed([b for r in self._in_flight for b in r.batches]))
        self._in_flight.clear()
        self._executor.clock.interrupted()
        if error is not None or self._runner.scheduled:
            self._runner.rebuild()
        if unknown:
            return
        if len(run.batches) > 1:
            for batch in reversed(run.batches):
                batch.runs_alone = True
                self._retry.appendleft(batch)
            return
        (batch,) = run.batches
        # Looking for its bad samples runs DALI too: through the gate, as any run.
        solo = self._executor.solo
        if not self._executor.gate.enter(solo, wait=True, stopping=self._stopping):
            self._retry.appendleft(batch)  # stopping: it stays this instance's to answer
            return
        try:
            self._delivery.recover(self._runner, batch, code, error, dict(batch.oversized or {}))
        finally:
            self._executor.gate.leave(solo)

    def _stopped_working(self, error: Exception) -> None:
        """Most likely the pipeline could not be rebuilt. Answers every batch it holds so that
        no trainer waits forever; with no other instance left, refuses new ones too (see
        handling/members.py: executor_for)."""
        executor = self._executor
        others = executor.instances.others_running(self._instance, built=True)
        log.exception(
            "DALI pipeline %d%s stopped working",
            executor.instance_id,
            " (one of its instances; the others go on)" if others else "",
        )
        queued: list[PendingBatch] = []
        if not others:
            executor.failed = True
            queued = self._planner.take_queued()
        message = f"the pipeline stopped working and takes no more batches: {error}"
        held = [] if self._held is None else [self._held]
        in_flight = [b for run in [*self._in_flight, *held] for b in run.batches]
        for batch in [*in_flight, *self._retry, *queued]:
            self._delivery.fail(batch, ErrorCode.PIPELINE_ERROR, message)
        # An instance that ends while others go on is one fewer for the controller too.
        self._executor.instances.retire(self._instance)
