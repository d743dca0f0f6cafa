"""One pipeline in the daemon: builds it, takes its jobs' batches and runs them on one or more
DALI instances of its graph, each in a thread of its own.

A pipeline of its own serves one job's registration; a shared pipeline (``sharing.py``) serves
every job that registered the same graph (its *members*, ``runs.py``). Each run starts with the
batch whose job comes first in the fair scheduler's order, which takes a slot; a shared
pipeline then fills the run with more batches, of any of its jobs, in the scheduler's order, up
to its run size (``run_planner.py``). A batch keeps its input frames until its outputs are
collected, because external_source with ``no_copy=True`` reads them in place.

A shared pipeline may run on several DALI instances of its graph at once, all taking batches
from the same members' queues; how many is measured (``instances.py``) or pinned by the
operator (``dali_instances.py``). Each instance's thread runs its own runs and recovers from
their failures (``run_loop.py``); each run's outputs go to its batches' jobs
(``delivery.py``). A job's batches may finish out of order across instances (its trainer waits
for each by its id).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dalid.protocol import PipelineStatus

from ..outputs.store import Stream
from ..pipelines.runner import PipelineRunner
from ..pipelines.sharing import batches_a_run
from ..pipelines.spec import PipelineBuildError, PipelineSpec
from .dali_instances import DaliInstances, Instance, InstanceRoom
from .delivery import Delivery
from .instances import InstanceController
from .job_window import TRAINER_HOLDS
from .run_gate import RunGate
from .run_loop import RunLoop
from .run_planner import RunPlanner
from .runs import Member, PendingBatch, Run
from .scheduler import FairScheduler, ServiceClock
from .stopping import Stop

__all__ = ["ExecutorParts", "ExecutorSettings", "InstanceRoom", "OnBuilt", "PipelineExecutor"]

log = logging.getLogger("dalid.server")

OnBuilt = Callable[[PipelineSpec | PipelineBuildError], None]


@dataclass(frozen=True)
class ExecutorSettings:
    """What a pipeline of the daemon is and how it runs: ``instance_id`` and ``name`` name it;
    ``shared``: its runs mix the batches of several members, up to ``run_batches`` batches'
    worth of samples (0: as ``sharing.batches_a_run`` chooses for the pipeline's batch size);
    ``private_reason`` says why a pipeline is not shared ("" for a shared one);
    ``max_image_pixels`` bounds the pixels an image sample of its batches may declare (0: no
    bound; ``badsamples.oversized_images``);
    ``device_id`` is its instances' GPU (None: CPU pipelines); ``solo_runs``: on probation
    after a crash (flight.py), its next runs that go into DALI alone."""

    instance_id: int
    name: str
    shared: bool = False
    run_batches: int = 1
    private_reason: str = ""
    max_image_pixels: int = 0
    device_id: int | None = None
    solo_runs: int = 0


@dataclass(frozen=True)
class ExecutorParts:
    """What an executor works with, and whom it tells. ``make_runner`` builds its DALI
    pipeline (once per instance); each run holds a slot of ``scheduler``
    (None: no limit); a shared pipeline's DALI hands outputs over on ``stream`` (a GPU
    daemon's own stream for the pipeline), which the executor owns and closes; ``controller``
    and ``room`` size its instances (``DaliInstances``), and ``on_run`` hears whether it has
    runs in DALI. ``on_empty`` is called once the last member has left, ``on_private`` when a
    pipeline meant to be shared turns out, once built, to look across the batch (it then runs
    one batch at a time). Its runs go into DALI through the daemon's ``gate`` (a gate of
    its own if None), and ``on_cleared`` hears when a pipeline on probation has run its solo
    runs."""

    make_runner: Callable[..., PipelineRunner]
    scheduler: FairScheduler | None = None
    stream: Stream | None = None
    controller: InstanceController | None = None
    room: InstanceRoom | None = None
    on_run: Callable[[bool], None] | None = None
    on_empty: Callable[[PipelineExecutor], None] | None = None
    on_private: Callable[[PipelineExecutor], None] | None = None
    gate: RunGate | None = None
    on_cleared: Callable[[], None] | None = None


class PipelineExecutor:
    """Builds one pipeline and runs the batches of its members, in a thread of its own.

    Building happens in that thread too, so a slow build never holds up the daemon's other
    jobs: ``parts.make_runner`` builds it, and each member's ``on_built`` receives the built
    pipeline's spec, or the PipelineBuildError, once it is done (at once for a member that
    joins later); ``spec`` is None until then. ``first`` is the member that registered it;
    ``settings`` say what it is and how it runs, ``parts`` what it works with (each in its
    docstring). The members' queues and windows are its planner's, under the planner's lock;
    the build's outcome is under its own, the instances under theirs.
    """

    def __init__(
        self, settings: ExecutorSettings, parts: ExecutorParts, first: Member, on_built: OnBuilt
    ) -> None:
        instance_id, name, shared = settings.instance_id, settings.name, settings.shared
        self.instance_id = instance_id
        self.name = name
        self.shared = shared
        self.run_batches = settings.run_batches if shared else 1
        self.spec: PipelineSpec | None = None
        self.runner: PipelineRunner | None = None
        self.failed = False
        self.runs = 0
        self.samples_run = 0
        self.mixed_runs = 0
        # Why a pipeline is not shared ("" for a shared one).
        self.private_reason = settings.private_reason
        self._make_runner = parts.make_runner
        self._scheduler = parts.scheduler
        self._own_stream = parts.stream
        self._on_empty = parts.on_empty
        self._on_private = parts.on_private
        # The build's outcome and who waits for it, under ``_building``.
        self._building = threading.Lock()
        self._build_error: PipelineBuildError | None = None
        self._waiting_for_build: list[tuple[Member, OnBuilt]] = []
        self._counting = threading.Lock()  # the figures above, learnt from every instance
        self.clock = ServiceClock()
        self.stopping = threading.Event()
        # The daemon's gate into DALI; on probation after a crash (flight.py), the pipeline's
        # next ``solo_runs`` runs go in alone, and ``on_cleared`` hears when they have.
        self.gate = parts.gate if parts.gate is not None else RunGate()
        self.solo = settings.solo_runs > 0
        self._solo_runs = settings.solo_runs
        self._on_cleared = parts.on_cleared
        # Members, their queues, their windows and the next run; every instance plans on it
        # (the slots it holds are its thread's).
        self.planner = RunPlanner(
            parts.scheduler, self.clock, self.stopping, settings.max_image_pixels
        )
        self.planner.shared = self.shared
        self.delivery = Delivery(instance_id, self.planner, self.stopping)
        # How many DALI instances run the graph (shared pipelines only; else one, always).
        self.instances = DaliInstances(
            instance_id,
            name,
            self._size_windows,
            controller=parts.controller if shared else None,
            room=parts.room,
            device_id=settings.device_id,
            on_run=parts.on_run,
        )
        self.join(first, on_built)
        self.instances.start(Instance(), self._run_first)

    @property
    def members(self) -> list[Member]:
        return self.planner.members

    @property
    def instances_reason(self) -> str:
        controller = self.instances.controller
        return controller.reason if controller is not None else ""

    @property
    def run_size(self) -> int:
        """The most samples one run holds (0 until built)."""
        if self.spec is None:
            return 0
        batch = self.spec.max_batch_size
        return batch * batches_a_run(self.run_batches, batch)

    def status(self) -> PipelineStatus:
        """The pipeline for ``dalid status``: its jobs and how full its runs are."""
        jobs = tuple(sorted({member.job_id for member in self.planner.members_now()}))
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
            instances=max(self.instances.running(), 1),
            instances_reason=self.instances_reason,
            instance_runs=self.instances.runs(),
        )

    # --- members ------------------------------------------------------------------------------

    def join(self, member: Member, on_built: OnBuilt) -> None:
        """Adds a job's registration; ``on_built`` hears of the build (now, if it is done)."""
        member.executor = self
        with self._building:
            self.planner.add(member)
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
        if not self.planner.remove(member):
            return Stop(self.name, None)
        # Never on the caller's thread for long (Note [A pipeline stuck inside DALI]).
        stop = Stop(str(self.instance_id), self.stop)
        if self._on_empty is not None:
            self._on_empty(self)
        return stop

    def submit(self, batch: PendingBatch) -> None:
        self.planner.submit(batch)

    def ran_solo(self) -> None:
        """From an instance's thread: a solo run came out of DALI, the daemon alive."""
        with self._counting:
            self._solo_runs -= 1
            cleared = self.solo and self._solo_runs <= 0
            if cleared:
                self.solo = False
        if cleared:
            log.info(
                "DALI pipeline %d %r ran its runs on probation alone, cleanly: its runs go "
                "beside others' again",
                self.instance_id,
                self.name,
            )
            if self._on_cleared is not None:
                self._on_cleared()

    @property
    def window(self) -> int:
        """The most batches a job holds at once (Note [A job's window] in job_window.py)."""
        return self.planner.window

    def want(self, member: Member, batch_id: int) -> None:
        """``member``'s trainer waits for ``batch_id`` (Note [A job's window])."""
        self.planner.want(member, batch_id)

    def sender_left(self, member: Member, first_id: int, end_id: int) -> None:
        """The worker of ``member``'s batch ids ``first_id <= id < end_id`` left (Note [A
        job's window])."""
        self.planner.sender_left(member, first_id, end_id)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stops the threads of every instance, dropping batches not yet run; whether they
        stopped. Idempotent."""
        self.stopping.set()
        self.planner.wake()
        deadline = time.monotonic() + timeout
        while True:
            threads = self.instances.threads()
            waiting = [t for t in threads if t is not threading.current_thread() and t.is_alive()]
            if not waiting:
                return True
            for thread in waiting:
                thread.join(max(deadline - time.monotonic(), 0.0))
            if any(thread.is_alive() for thread in waiting):
                log.warning(
                    "DALI pipeline %d did not stop within %.0f s", self.instance_id, timeout
                )
                return False

    # --- the instances' threads -----------------------------------------------------------------

    def _size_windows(self, running: int) -> None:
        """Each job's window: the prefetch of every instance running the graph, and the batch
        its trainer holds (Note [A job's window] in job_window.py). Told by the instances under
        their lock."""
        spec = self.spec
        if spec is not None:
            self.planner.window = spec.prefetch_queue_depth * max(1, running) + TRAINER_HOLDS

    def look(self) -> None:
        """From any instance's thread, now and then: the instance controller's look."""
        self.instances.look(
            self.samples_run,
            self.planner.waiting,
            self.stopping,
            lambda instance: self.instances.start(instance, self._run_extra),
            self.planner.wake,
        )

    def _build(self, instance: Instance) -> PipelineRunner:
        return self._make_runner(
            on_run=functools.partial(self.instances.holds_runs, instance), instance=instance.number
        )

    def _run_first(self, instance: Instance) -> None:
        """The first instance's thread: builds the pipeline, tells the members, then runs."""
        try:
            try:
                runner = self._build(instance)
            except PipelineBuildError as error:
                self.failed = True
                self._built(error)
                return
            if runner.spec.exec_dynamic:
                # The default executor hands outputs over on a stream, without a host sync: the
                # pipeline's own if shared, else its job's (None on a CPU daemon).
                if self.shared:
                    own = self._own_stream
                    self.delivery.stream = None if own is None else own.handle
                else:
                    first = self.planner.first_member()
                    self.delivery.stream = None if first is None else first.outputs.stream
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
                    self.shared = self.planner.shared = False
                    self.instances.controller = None
                    self.private_reason = why
                    if self._on_private is not None:
                        self._on_private(self)
            self.runner = runner
            # Read from the graph once built, before any batch is prepared (sizes.py).
            self.planner.sized_outputs = runner.sized_outputs
            self.instances.built(instance, runner)
            self._built(runner.spec)
            self._run_instance(instance, runner)
        finally:
            self._ended(instance)

    def _run_extra(self, instance: Instance) -> None:
        """The thread of an instance past the first: builds its DALI pipeline of the same
        graph, then runs batches of the same queues until dropped or stopped."""
        try:
            try:
                runner = self._build(instance)
            except PipelineBuildError as error:
                log.warning(
                    "DALI pipeline %d: another instance could not be built: %s",
                    self.instance_id,
                    error,
                )
                return
            self.instances.built(instance, runner)
            controller = self.instances.controller
            if controller is not None:
                controller.started(time.monotonic())
            self._run_instance(instance, runner)
        finally:
            self._ended(instance)

    def _run_instance(self, instance: Instance, runner: PipelineRunner) -> None:
        """An instance's runs, on its built runner, until it is dropped or the pipeline stops;
        then its DALI pipeline goes."""
        try:
            RunLoop(self, instance, runner).run()
        finally:
            runner.close()

    def _ended(self, instance: Instance) -> None:
        """``instance``'s thread ends: its threads go back; the last one closes the stream."""
        if self.instances.ended(instance) and self._own_stream is not None:
            self._own_stream.close()

    def _built(self, outcome: PipelineSpec | PipelineBuildError) -> None:
        with self._building:
            if isinstance(outcome, PipelineSpec):
                self.spec = outcome
                self.planner.run_size = self.run_size
                self.planner.path_inputs = outcome.path_inputs
                self.delivery.path_inputs = outcome.path_inputs
                self.instances.resized()
            else:
                self._build_error = outcome
            waiting, self._waiting_for_build = self._waiting_for_build, []
        for _, on_built in waiting:
            on_built(outcome)

    def account(self, run: Run) -> None:
        """Learns from a run that came out of DALI: its service time, charged to its jobs."""
        samples = run.samples
        mixed = len(run.batches) > 1 and len({b.member.job_id for b in run.batches if b.member}) > 1
        # Instances run side by side: the clock then learns the pipeline's time per sample.
        with self._counting:
            service = self.clock.batch_done(samples, run.entered, time.monotonic())
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
                # Charged once, split among the jobs that consume it (Note [Cohort outputs]).
                entry.account(share)
            else:
                self._scheduler.charge(batch.member.job_id, share)
