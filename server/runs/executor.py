"""One thread per pipeline in the daemon: forms runs of its jobs' batches, runs them in DALI and
hands each batch's rows of the outputs to its own job.

A pipeline of its own serves one job's registration; a shared pipeline (``sharing.py``) serves
every job that registered the same graph (its *members*, ``runs.py``). Each run starts with the
batch whose job comes first in the fair scheduler's order, which takes a slot; a shared
pipeline then fills the run with more batches, of any of its jobs, in the scheduler's order, up
to its run size (the batches ride in that slot, charged to their jobs). The executor keeps up
to ``prefetch_queue_depth`` runs inside DALI, so that decoding of the next run overlaps the
copy-out of the previous one. A batch keeps its input frames until its outputs are collected,
because external_source with ``no_copy=True`` reads them in place.

A run that fails kills the DALI pipeline: the executor rebuilds it and runs the batches of a
mixed run again one by one, so that a bad sample of one job never fails or skips another job's
samples; a batch that fails alone is answered by its job's on_error policy
(``badsamples.py``), and that job's next batches run alone for a while.

A shared pipeline may run on several DALI instances of its graph at once, each in a thread of
its own with its own runner, runs in flight and scheduler slots, all taking batches from the
same members' queues; how many is measured (``instances.py``) or pinned by the operator. A
failure stays the instance's own: it rebuilds its DALI pipeline and runs its own failed runs
again, while the others go on; one that cannot be rebuilt fails its own batches and ends,
and the pipeline stops working only when its last instance does. A job's batches may finish
out of order across instances (its trainer waits for each by its id).

Why one module of some 800 lines: it is one class, the loop of its instances' threads and the
recovery of their failed runs, which share that state.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from dalid.protocol import (
    BadSample,
    BatchFailed,
    BatchReady,
    ErrorCode,
    OnError,
    PipelineStatus,
)

from ..outputs.outputs import OutputFailure, RunOutput, Stream
from ..outputs.pool import PoolClosed, PoolFull
from ..pipelines.runner import PipelineBuildError, PipelineRunner, PipelineSpec
from ..pipelines.sharing import batches_a_run
from ..samples.badsamples import recover, summary
from ..samples.paths import unseen_file
from .cohorts import resubmit
from .instances import Change, CpuMeter, GpuMeter, InstanceController, Load
from .run_planner import TRAINER_HOLDS, RunPlanner
from .runs import QUARANTINE_BATCHES, Member, PendingBatch, Run
from .scheduler import FairScheduler, ServiceClock
from .stopping import Stop

log = logging.getLogger("dalid.server")

OnBuilt = Callable[[PipelineSpec | PipelineBuildError], None]

# How often an instance's thread looks at the load for the controller (instances.py): at
# the queues and the GPU's utilisation every _LOOK_S, at the CPUs every _CPU_METER_S. The CPU
# meter's readings are differences of the kernel's counters, each covering the time since the
# one before, so a period's mean is the same read less often; each read of /proc/stat costs
# the executor's thread 15 µs hot and several times that with DALI's workers filling the
# caches, at any rate of batches. (NVML's utilisation is a recent sample, not a counter: it
# is read at every look.)
_LOOK_S = 0.25
_CPU_METER_S = 1.0


class InstanceRoom(Protocol):
    """Where another DALI instance of a pipeline takes its threads from: ``take`` gives the
    threads one more instance of pipeline ``instance_id`` may have (0: none fits), ``give``
    returns them."""

    def take(self, instance_id: int) -> int: ...

    def give(self, instance_id: int, threads: int) -> None: ...


class _Instance:
    """One DALI instance of a pipeline: its thread, its runner once built, its threads."""

    def __init__(self, number: int, threads: int = 0) -> None:
        self.number = number
        self.threads = threads  # taken from the InstanceRoom (0 for the first instance)
        self.runner: PipelineRunner | None = None
        self.thread: threading.Thread | None = None
        # Dropped by the controller: it takes no more runs and ends once its own are done.
        self.retiring = False
        self.runs = 0  # runs it collected from DALI, and their samples
        self.samples = 0


class PipelineExecutor:
    """Builds one pipeline and runs the batches of its members, in a thread of its own.

    Building happens in that thread too, so a slow build never holds up the daemon's other
    jobs: ``make_runner`` builds it, and each member's ``on_built`` receives the built
    pipeline's spec, or the PipelineBuildError, once it is done (at once for a member that
    joins later); ``spec`` is None until then. ``shared``: runs mix the batches of several
    members up to ``run_batches`` batches' worth of samples (0: as ``sharing.batches_a_run``
    chooses for the pipeline's batch size), and DALI hands outputs over on
    ``stream`` (a GPU daemon's own stream for the pipeline). Each run holds a slot of
    ``scheduler`` (None: no limit). ``first`` is the member that registered it; ``on_empty``
    is called once the last member has left, ``on_private`` when a pipeline meant to be shared
    turns out, once built, to look across the batch (it then runs one batch at a time).
    """

    def __init__(
        self,
        instance_id: int,
        name: str,
        make_runner: Callable[..., PipelineRunner],
        first: Member,
        on_built: OnBuilt,
        *,
        shared: bool = False,
        run_batches: int = 1,
        scheduler: FairScheduler | None = None,
        stream: Stream | None = None,
        max_image_pixels: int = 0,
        on_empty: Callable[[PipelineExecutor], None] | None = None,
        on_private: Callable[[PipelineExecutor], None] | None = None,
        private_reason: str = "",
        controller: InstanceController | None = None,
        room: InstanceRoom | None = None,
        device_id: int | None = None,
        on_run: Callable[[bool], None] | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.name = name
        self.shared = shared
        self.run_batches = run_batches if shared else 1
        self.spec: PipelineSpec | None = None
        self.runner: PipelineRunner | None = None
        self.failed = False
        self.runs = 0
        self.samples_run = 0
        self.mixed_runs = 0
        # Why a pipeline is not shared ("" for a shared one).
        self.private_reason = private_reason
        self._make_runner = make_runner
        # Told when DALI holds runs of the pipeline, on any of its instances, and when none.
        self._on_run = on_run
        self._holding: set[int] = set()  # the instances whose DALI holds runs
        self._scheduler = scheduler
        self._own_stream = stream
        # The stream DALI hands outputs over on (the default executor only), or None: the host.
        self._stream: int | None = None
        self._max_image_pixels = max_image_pixels
        self._on_empty = on_empty
        self._on_private = on_private
        self._build_error: PipelineBuildError | None = None
        self._waiting_for_build: list[tuple[Member, OnBuilt]] = []
        self._clock = ServiceClock()
        self._stopping = threading.Event()
        # Members, their queues and the next run; its lock also guards the build's outcome and
        # the instances. Every instance plans on it (the slots it holds are its thread's).
        self._planner = RunPlanner(scheduler, self._clock, self._stopping, max_image_pixels)
        self._planner.shared = self.shared
        self._changed = self._planner.changed
        # How many DALI instances run the graph (shared pipelines only; None: one, always).
        self._controller = controller if shared else None
        self._room = room
        # The load the controller looks at; nothing to read for a pipeline without one.
        self._cpu = CpuMeter() if self._controller is not None else None
        self._gpu = GpuMeter(device_id) if self._controller is not None else None
        self._looking = threading.Lock()
        self._next_look = 0.0
        self._next_cpu_meter = 0.0
        self._counting = threading.Lock()
        self._instances: list[_Instance] = []
        self._next_number = 0
        self.join(first, on_built)
        self._start_instance(_Instance(0), self._run)

    @property
    def members(self) -> list[Member]:
        return self._planner.members

    @property
    def instances(self) -> int:
        """DALI instances running the graph, or starting (not those ending)."""
        with self._changed:
            return self._running()

    def _running(self) -> int:
        """The instances not ending (under ``_changed``)."""
        return sum(not instance.retiring for instance in self._instances)

    def _instance_runs(self) -> tuple[int, ...]:
        with self._changed:
            return tuple(instance.runs for instance in self._instances if not instance.retiring)

    @property
    def instances_reason(self) -> str:
        return self._controller.reason if self._controller is not None else ""

    @property
    def run_size(self) -> int:
        """The most samples one run holds (0 until built)."""
        if self.spec is None:
            return 0
        batch = self.spec.max_batch_size
        return batch * batches_a_run(self.run_batches, batch)

    def status(self) -> PipelineStatus:
        """The pipeline for ``dalid status``: its jobs and how full its runs are."""
        with self._changed:
            jobs = tuple(sorted({member.job_id for member in self.members}))
        run_size = self.run_size if self.shared else (self.spec.max_batch_size if self.spec else 0)
        runner = self.runner
        return PipelineStatus(
            pipeline=self.instance_id,
            name=self.name,
            shared=self.shared,
            jobs=jobs,
            run_size=run_size,
            threads=runner.num_threads if runner is not None else 0,
            runs=self.runs,
            samples=self.samples_run,
            mean_fill=self.samples_run / (self.runs * run_size) if self.runs and run_size else 0.0,
            mixed_runs=self.mixed_runs,
            private_reason=self.private_reason,
            threads_asked=runner.threads_asked if runner is not None else 0,
            instances=max(self.instances, 1),
            instances_reason=self.instances_reason,
            instance_runs=self._instance_runs(),
        )

    # --- members ------------------------------------------------------------------------------

    def join(self, member: Member, on_built: OnBuilt) -> None:
        """Adds a job's registration; ``on_built`` hears of the build (now, if it is done)."""
        member.executor = self
        with self._changed:
            self._planner.add(member)
            outcome: PipelineSpec | PipelineBuildError | None = self.spec or self._build_error
            if outcome is None:
                self._waiting_for_build.append((member, on_built))
        if outcome is not None:
            on_built(outcome)

    def leave(self, member: Member) -> Stop:
        """Removes a job's registration, dropping its queued batches; once it returns no write
        into the job's memory is under way or to come. Stops the thread with the last member.
        Its stop says when it is safe to unmap the job's memory (``stopped``; never while the
        thread may still be inside DALI with its samples)."""
        member.closed = True  # an allocation waiting in a write sees it and gives up
        with member.writing:
            pass
        if not self._planner.remove(member):
            return Stop(self.name, None)
        # Never on the caller's thread for long (Note [A pipeline stuck inside DALI]).
        stop = Stop(str(self.instance_id), self.stop)
        if self._on_empty is not None:
            self._on_empty(self)
        return stop

    def submit(self, batch: PendingBatch) -> None:
        self._planner.submit(batch)

    @property
    def window(self) -> int:
        """The most batches a job holds at once (Note [A job's window] in run_planner.py)."""
        return self._planner.window

    def want(self, member: Member, batch_id: int) -> None:
        """``member``'s trainer waits for ``batch_id`` (Note [A job's window])."""
        self._planner.want(member, batch_id)

    def sender_left(self, member: Member, first_id: int, end_id: int) -> None:
        """The worker of ``member``'s batch ids ``first_id <= id < end_id`` left (Note [A
        job's window], point 6)."""
        self._planner.sender_left(member, first_id, end_id)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stops the threads of every instance, dropping batches not yet run; whether they
        stopped. Idempotent."""
        self._stopping.set()
        self._planner.wake()
        deadline = time.monotonic() + timeout
        stopped = True
        while True:
            with self._changed:
                threads = [i.thread for i in self._instances if i.thread is not None]
            waiting = [t for t in threads if t is not threading.current_thread() and t.is_alive()]
            if not waiting:
                return stopped
            for thread in waiting:
                thread.join(max(deadline - time.monotonic(), 0.0))
            if any(thread.is_alive() for thread in waiting):
                log.warning(
                    "DALI pipeline %d did not stop within %.0f s", self.instance_id, timeout
                )
                return False

    # --- instances ------------------------------------------------------------------------------

    def _start_instance(self, instance: _Instance, target: Callable[[_Instance], None]) -> None:
        with self._changed:
            instance.number = self._next_number
            self._next_number += 1
            suffix = f".{instance.number}" if instance.number else ""
            instance.thread = threading.Thread(
                target=target,
                args=(instance,),
                name=f"dalid-pipeline-{self.instance_id}{suffix}",
                daemon=True,
            )
            self._instances.append(instance)
            self._size_windows()
        instance.thread.start()

    def _size_windows(self) -> None:
        """Each job's window: the prefetch of every instance running the graph, and the batch
        its trainer holds (Note [A job's window] in run_planner.py, point 1). Under
        ``_changed``, or before any thread runs."""
        if self.spec is None:
            return
        running = max(1, self._running())
        self._planner.window = self.spec.prefetch_queue_depth * running + TRAINER_HOLDS

    def _ended(self, instance: _Instance) -> None:
        """``instance``'s thread ends: its threads go back; the last one closes the stream."""
        with self._changed:
            if instance in self._instances:
                self._instances.remove(instance)
            last = not self._instances
            self._size_windows()
        if instance.threads and self._room is not None:
            self._room.give(self.instance_id, instance.threads)
        if last and self._own_stream is not None:
            self._own_stream.close()

    def _look(self) -> None:
        """From any instance's thread, now and then: the controller's look at the load, and
        the change it asks for."""
        controller = self._controller
        now = time.monotonic()
        if (
            controller is None
            or self._cpu is None
            or now < self._next_look
            or not self._looking.acquire(False)
        ):
            return
        try:
            self._next_look = now + _LOOK_S
            with self._changed:
                waiting = any(member.queue for member in self.members)
                count = self._running()
            cpu = None
            if now >= self._next_cpu_meter:
                self._next_cpu_meter = now + _CPU_METER_S
                cpu = self._cpu.read()
            load = Load(
                self.samples_run,
                waiting,
                cpu_busy=cpu[0] if cpu is not None else None,
                cores=self._cpu.cores if cpu is not None else 0,
                gpu_busy=self._gpu.read() if self._gpu is not None else None,
                daemon_cpu=cpu[1] if cpu is not None else None,
            )
            change = controller.observe(now, count, load)
            if change is Change.ADD and not self._stopping.is_set() and self._room is not None:
                threads = self._room.take(self.instance_id)
                if threads:
                    log.info(
                        "DALI pipeline %d %r: one more instance (%s)",
                        self.instance_id,
                        self.name,
                        controller.reason,
                    )
                    self._start_instance(_Instance(0, threads), self._run_more)
            elif change is Change.DROP:
                with self._changed:
                    extra = [i for i in self._instances if i.number and not i.retiring]
                    if extra:
                        extra[-1].retiring = True
                        self._size_windows()
                if extra:
                    log.info(
                        "DALI pipeline %d %r: one instance fewer (%s)",
                        self.instance_id,
                        self.name,
                        controller.reason,
                    )
                    self._planner.wake()
        finally:
            self._looking.release()

    def _holds_runs(self, instance: _Instance, running: bool) -> None:
        """From an instance's runner: its DALI holds runs, or none. The pipeline holds runs
        while any instance's does (flight.py attributes a crash to it)."""
        if self._on_run is None:
            return
        with self._counting:
            if running:
                self._holding.add(instance.number)
            else:
                self._holding.discard(instance.number)
            holding = bool(self._holding)
        if running or not holding:
            self._on_run(holding)

    def _run_more(self, instance: _Instance) -> None:
        """The thread of an instance past the first: builds its DALI pipeline of the same
        graph, then runs batches of the same queues until dropped or stopped."""
        try:
            try:
                runner = self._make_runner(on_run=functools.partial(self._holds_runs, instance))
            except PipelineBuildError as error:
                log.warning(
                    "DALI pipeline %d: another instance could not be built: %s",
                    self.instance_id,
                    error,
                )
                return
            instance.runner = runner
            if self._controller is not None:
                self._controller.started(time.monotonic())
            self._serve(instance, runner)
        finally:
            self._ended(instance)

    def _serve(self, instance: _Instance, runner: PipelineRunner) -> None:
        """An instance's runs, on its built runner, until it is dropped or the pipeline stops;
        then its DALI pipeline goes."""
        try:
            self._loop(instance, runner)
        finally:
            runner.close()

    # --- the thread -----------------------------------------------------------------------------

    def _run(self, instance: _Instance) -> None:
        try:
            try:
                runner = self._make_runner(on_run=functools.partial(self._holds_runs, instance))
            except PipelineBuildError as error:
                self.failed = True
                self._built(error)
                return
            if runner.spec.exec_dynamic:
                # The default executor hands outputs over on a stream, without a host sync: the
                # pipeline's own if shared, else its job's (None on a CPU daemon).
                if self.shared:
                    self._stream = None if self._own_stream is None else self._own_stream.handle
                else:
                    with self._changed:
                        first = self.members[0] if self.members else None
                    self._stream = None if first is None else first.outputs.stream
            if self.shared and runner.spec.definition is not None:
                # A pipeline of the repository shows what it is only once built.
                why = runner.unshareable()
                if why:
                    log.info(
                        "DALI pipeline %d %r runs for its job alone, not shared with other jobs: "
                        "%s",
                        self.instance_id,
                        self.name,
                        why,
                    )
                    self.shared = self._planner.shared = False
                    self._controller = None
                    self.private_reason = why
                    if self._on_private is not None:
                        self._on_private(self)
            self.runner = instance.runner = runner
            self._built(runner.spec)
            self._serve(instance, runner)
        finally:
            self._ended(instance)

    def _built(self, outcome: PipelineSpec | PipelineBuildError) -> None:
        with self._changed:
            if isinstance(outcome, PipelineSpec):
                self.spec = outcome
                self._planner.run_size = self.run_size
                self._planner.path_inputs = outcome.path_inputs
                self._size_windows()
            else:
                self._build_error = outcome
            waiting, self._waiting_for_build = self._waiting_for_build, []
        for _, on_built in waiting:
            on_built(outcome)

    def _loop(self, instance: _Instance, runner: PipelineRunner) -> None:
        # Every run in ``in_flight`` holds a slot of the scheduler, taken before DALI gets it
        # and given back once DALI is done with it.
        in_flight: collections.deque[Run] = collections.deque()
        retry: collections.deque[PendingBatch] = collections.deque()
        depth = runner.spec.prefetch_queue_depth

        def start_over(failed: Run, code: ErrorCode, error: Exception | None) -> None:
            # After a failure the DALI pipeline is dead, and looking for bad samples needs an
            # idle one: rebuild, then run again the runs that were inside the old pipeline,
            # in their order (they take their slots anew). The batches of a failed mixed run
            # go first, each alone; a batch that fails alone is answered now.
            self._planner.give_slots(len(in_flight))
            retry.extendleft(reversed([b for run in in_flight for b in run.batches]))
            in_flight.clear()
            self._clock.interrupted()
            if error is not None or runner.scheduled:
                runner.rebuild()
            if len(failed.batches) > 1:
                for batch in reversed(failed.batches):
                    batch.alone = True
                    retry.appendleft(batch)
                return
            (batch,) = failed.batches
            self._recover(runner, batch, code, error, dict(batch.oversized or {}))

        try:
            while not self._stopping.is_set():
                self._look()
                if instance.retiring and not retry and not in_flight:
                    break  # dropped, and its own runs are done
                while len(in_flight) < depth and (retry or not instance.retiring):
                    run = self._planner.next_run(retry, block=not in_flight)
                    if run is None:
                        break
                    first = run.batches[0]
                    if first.unseen:
                        # Not a bad sample: every batch would fail so (see paths.py).
                        self._planner.give_slots(1)
                        self._fail(first, ErrorCode.INVALID_BATCH, first.unseen)
                        continue
                    if first.oversized:
                        self._planner.give_slots(1)
                        start_over(run, ErrorCode.INVALID_BATCH, None)
                        continue
                    try:
                        run.entered = time.monotonic()
                        runner.schedule(run.arrays())
                    except Exception as error:
                        self._planner.give_slots(1)
                        start_over(run, ErrorCode.INVALID_BATCH, error)
                        continue
                    in_flight.append(run)
                if self._stopping.is_set() or not in_flight:
                    continue
                run = in_flight.popleft()
                try:
                    outputs = runner.collect(self._stream)
                except Exception as error:
                    self._planner.give_slots(1)
                    start_over(run, ErrorCode.PIPELINE_ERROR, error)
                    continue
                self._account(run)
                instance.runs += 1
                instance.samples += run.samples
                self._planner.give_slots(1, retry)
                self._deliver(run, [RunOutput(i, output) for i, output in enumerate(outputs)])
                del outputs
                runner.release()
        except Exception as error:
            # Most likely the pipeline could not be rebuilt. Answer every batch it holds so that
            # no trainer waits forever; with no other instance left, refuse new ones too (see
            # pipelines.executor_for).
            # (Only built instances count: one still building may yet fail too.)
            with self._changed:
                others = any(
                    i is not instance and not i.retiring and i.runner is not None
                    for i in self._instances
                )
            log.exception(
                "DALI pipeline %d%s stopped working",
                self.instance_id,
                " (one of its instances; the others go on)" if others else "",
            )
            queued: list[PendingBatch] = []
            if not others:
                self.failed = True
                queued = self._planner.take_queued()
            message = f"the pipeline stopped working and takes no more batches: {error}"
            for batch in [*(b for run in in_flight for b in run.batches), *retry, *queued]:
                self._fail(batch, ErrorCode.PIPELINE_ERROR, message)
            # An instance that ends while others go on is one fewer for the controller too.
            instance.retiring = True
        finally:
            with self._changed:
                others = (
                    any(i is not instance and not i.retiring for i in self._instances)
                    and not self._stopping.is_set()
                )
            self._planner.give_up(last=not others)

    def _account(self, run: Run) -> None:
        """Learns from a run that came out of DALI: its service time, charged to its jobs."""
        samples = run.samples
        mixed = len(run.batches) > 1 and len({b.member.job_id for b in run.batches if b.member}) > 1
        # Instances run side by side: the clock then learns the pipeline's time per sample.
        with self._counting:
            service = self._clock.batch_done(samples, run.entered, time.monotonic())
            self.runs += 1
            self.samples_run += samples
            self.mixed_runs += mixed
        if self._scheduler is None or samples == 0:
            return
        for batch in run.batches:
            if batch.member is None:
                continue
            share = service * batch.size / samples
            entry = batch.cohort_entry
            if entry is not None:
                # Charged once, split among the jobs that consume it (cohorts.py, point 5).
                entry.account(share)
            else:
                self._scheduler.charge(batch.member.job_id, share)

    # --- outputs --------------------------------------------------------------------------------

    def _deliver(self, run: Run, outputs: Sequence[RunOutput]) -> None:
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
                if member.alone:
                    member.alone -= 1

    def _deliver_to_cohort(
        self, batch: PendingBatch, outputs: Sequence[RunOutput], rows: range
    ) -> None:
        """A batch's rows of a run, for every member of its cohort waiting for the same inputs:
        into the cohort's memory, or else into each one's own (Note [Cohort outputs] in
        cohorts.py). Its own job may have ended: the others still get them."""
        entry = batch.cohort_entry
        assert entry is not None
        descriptors = entry.write(outputs, rows, self._stream)
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
                if member.alone:
                    member.alone -= 1
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
        for it run their own (cohorts.py, Note [Cohort outputs], point 4)."""
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
                    source_stream=self._stream,
                    cancelled=lambda: self._stopping.is_set() or member.closed,
                    # Other jobs' batches wait for this run's end: no waiting for this job.
                    wait=len(self._planner.members) < 2,
                )
            except PoolFull:
                # Note [Private copies] in copies.py.
                descriptors, copies, event = member.outputs.private_copies(
                    outputs, rows, source_stream=self._stream
                )
        except OutputFailure as failure:
            self._fail(batch, failure.code, str(failure))
            return
        except PoolClosed:
            return  # the job ended while its outputs waited for room
        except Exception as error:
            # Whatever went wrong writing it, its trainer waits for an answer: it gets one.
            log.exception("pipeline %d: writing batch %d failed", self.instance_id, batch.batch_id)
            self._fail(
                batch, ErrorCode.INTERNAL_ERROR, f"its outputs could not be written: {error}"
            )
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

    def _fail(
        self,
        batch: PendingBatch,
        code: ErrorCode,
        message: str,
        bad_samples: Sequence[BadSample] = (),
    ) -> None:
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

    # --- bad samples ----------------------------------------------------------------------------

    def _recover(
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
        path_inputs = self.spec.path_inputs if self.spec is not None else ()
        if error is not None and path_inputs:
            # A file the daemon may not read, in a directory it enters, fails the run: checked
            # now, file by file (Note [Checking paths per directory] in paths.py).
            request = batch.request
            unseen = unseen_file(request.inputs, path_inputs, request.unreadable)
            if unseen:
                self._fail(batch, ErrorCode.INVALID_BATCH, unseen)
                return
        found = recover(
            runner,
            batch.arrays,
            size=batch.size,
            policy=member.on_error,
            failure=(code, error),
            bad=bad,
            stream=self._stream,
            path_inputs=path_inputs,
        )
        if found.report:
            # Another bad sample of this job then costs no other job a rerun.
            member.alone = QUARANTINE_BATCHES
        if found.outputs is None:
            self._fail(batch, found.code, found.message, found.report)
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
