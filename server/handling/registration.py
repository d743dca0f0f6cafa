"""Registering a job's pipelines: which pipeline in the daemon runs each, and which of them
takes a batch.

A registration names a client's serialized pipeline (``register_pipeline``) or a pipeline of the
daemon's repository (``register_named_pipeline``). Registrations of the same graph (``sharing.py``;
for the repository, the same name, definition, parameters and batch size) share one pipeline in
the daemon, whose runs mix their jobs' batches; a deterministic registration, or a graph whose
operators look across the batch, gets a pipeline of its own. A new pipeline's executor
(``executor.py``) builds it in its own thread, so that a slow build holds up no other job; the
reply leaves once it is built, or at once for a registration that joins a built one.

Before anything is built, a registration is checked as a whole: its graph's operators against
the allow-list and its outputs' declared sizes (``operators.py``), whether it was running when
the last daemon died (``flight.py``: refused, or on probation on a pipeline of its own whose
runs go into DALI alone, ``runs/run_gate.py``), and whether a new pipeline fits in the daemon's
pipelines and DALI threads.

What the pipelines hold of the daemon's DALI threads and room for pipelines is ``budget.py``'s.

Note [Two instances on a CPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On a CPU daemon, a shared pipeline under ``--instances auto`` runs on two DALI instances that
split its ``--threads`` (``instances.cpu_start``), and no more: one instance leaves its pool
idle through its executor thread's serial steps; instances of all the threads put twice the
cores' threads on the cores, and each one more holds DALI buffers of its own (a third held
about 220 MiB at batch 32, and three delivered no more than two). The two count as one pipeline
of the daemon's. A repository's pipeline (shareable or not, known once built), one a cohort
member starts, ``--instances N`` and GPU daemons are as before: docs/design/dali-instances.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from dalid.protocol import (
    Error,
    ErrorCode,
    Message,
    PipelineRegistered,
    PipelineStatus,
    RegisterNamedPipeline,
    RegisterPipeline,
)

from ..errors import RequestRefused
from ..jobs.jobs import Job
from ..outputs.store import StreamFactory, no_streams
from ..pipelines.flight import PROBATION_RUNS, FlightRecorder, Standing, graph_key, refusal
from ..pipelines.operators import ALLOW_LIST, OperatorPolicy, OperatorRefused, check_sizes
from ..pipelines.reload import LiveRepository
from ..pipelines.runner import PipelineRunner
from ..pipelines.sharing import UnreadablePipeline, read_graph
from ..pipelines.spec import CpuExecutor, PipelineBuildError, PipelineSpec
from ..runs.executor import ExecutorParts, ExecutorSettings, PipelineExecutor
from ..runs.instances import MAX_INSTANCES, InstanceController, cpu_start
from ..runs.run_gate import RunGate
from ..runs.runs import Answer, Member
from ..runs.scheduler import FairScheduler
from .budget import PipelineBudget
from .push import Push

log = logging.getLogger("dalid.server")

Registration = RegisterPipeline | RegisterNamedPipeline


@dataclass(frozen=True)
class Sharing:
    """How the pipelines of the daemon are shared: ``run_batches`` batches' worth of samples
    at most in one run of a shared pipeline (0: as many as fit 256 samples, 1 to 4:
    ``sharing.batches_a_run``), on ``threads`` DALI threads (0: as registered)."""

    enabled: bool = True
    run_batches: int = 0
    threads: int = 0
    # DALI instances of each shared pipeline (0: as many as measurement says pay, instances.py).
    instances: int = 0


SHARING = Sharing()
"""The default: pipelines shared, runs of up to 256 samples (1 to 4 batches), threads as
registered."""


@dataclass(frozen=True)
class Plan:
    """How to build a registered pipeline: ``make_runner`` builds it (in its executor's thread,
    given ``run_batches`` and ``num_threads``); registrations whose ``key`` is the same share
    one pipeline (None: none may share it, ``why_private`` says why); ``name`` is shown."""

    make_runner: Callable[..., PipelineRunner]
    key: Hashable
    why_private: str
    name: str
    # What names the graph for crash attribution (flight.py).
    flight_key: bytes = b""
    # Equal for registrations that may be members of one cohort (cohorts.py): the same graph,
    # inputs, outputs and batch size, shared with other jobs or not.
    cohort_key: Hashable = None
    # On probation after a crash (flight.py): its runs go into DALI alone, outside any cohort.
    probation: bool = False
    # Whether the graph may be shared is known before it is built (False: a repository's
    # pipeline, which may turn out to run alone, on the one instance it was built as).
    known_shareable: bool = True


class PipelineBuilder:
    """Builds the pipelines jobs register, for ``device_id`` (None: CPU pipelines only), and
    knows every pipeline the daemon runs."""

    def __init__(
        self,
        device_id: int | None,
        max_batch_size: int,
        repository: LiveRepository,
        scheduler: FairScheduler,
        push: Push,
        *,
        sharing: Sharing = SHARING,
        cpu_executor: CpuExecutor = CpuExecutor.LEGACY,
        streams: StreamFactory = no_streams,
        operators: OperatorPolicy = ALLOW_LIST,
        max_threads: int = 0,
        max_pipelines: int = 0,
        user_share: float = 0.0,
        recorder: FlightRecorder | None = None,
    ) -> None:
        # What each pipeline runs, for the next daemon should this one die (flight.py).
        self._recorder = recorder
        # The trainer pids of the jobs that registered each pipeline, by instance id.
        self._pids: dict[int, set[int]] = {}
        # The pipelines marked running in the recorder, by instance id: their graph's key and
        # name (a mark is written when DALI gets a run after none, not at every run).
        self._marked: dict[int, tuple[bytes, str]] = {}
        # The daemon's gate into DALI, which the runs of pipelines on probation take alone.
        self.gate = RunGate()
        self._device_id = device_id
        # A CPU daemon's pipelines on DALI's legacy executor (runner.CpuExecutor).
        self._legacy = device_id is None and cpu_executor is CpuExecutor.LEGACY
        # Which DALI operators a registered graph may hold (operators.py).
        self._operators = operators
        # DALI threads and pipelines of all pipelines together (budget.py).
        self.budget = PipelineBudget(max_threads, max_pipelines, user_share)
        self._max_batch_size = max_batch_size
        self._repository = repository
        self._scheduler = scheduler
        self._push = push
        self._sharing = sharing
        self._streams = streams
        self._next_pipeline_id = 1
        self._next_instance_id = 1
        # Every pipeline in the daemon by its instance id, and the shared ones by their key.
        # Changed by the I/O thread, and by an executor whose last member left.
        self._lock = threading.Lock()
        self.instances: dict[int, PipelineExecutor] = {}
        self._shared: dict[Hashable, PipelineExecutor] = {}

    def start(
        self,
        job: Job,
        request: Registration,
        request_id: int | None,
        answer: Answer,
        check: Callable[[Hashable], None] | None = None,
    ) -> Member:
        """Registers the pipeline for ``job``: joins the pipeline in the daemon that runs the
        same graph, or starts one. The trainer's reply leaves once it is built; ``answer``
        gets its batches' results. ``check`` is given the graph's cohort key (``Plan``) and
        may refuse the registration before anything starts."""
        plan = self._plan(job, request)
        if check is not None and not plan.probation:
            check(plan.cohort_key)
        with self._lock:
            shared = self._shared.get(plan.key) if plan.key is not None else None
            if shared is not None and shared.failed:
                shared = None
        # A new pipeline must fit in the daemon's: checked before anything changes.
        threads = self.budget.room(job.uid) if shared is None else 0
        pipeline_id = self._next_pipeline_id
        self._next_pipeline_id += 1
        job.adopt_earlier_ids(request, pipeline_id)
        member = Member(
            job.job_id,
            pipeline_id,
            job.outputs,
            answer,
            request.on_error,
            deterministic=request.deterministic,
            read_bytes=job.limits.max_message_bytes,
            output_bytes=job.limits.pool_bytes,
        )
        on_built = functools.partial(self._on_built, job, member, request, request_id)
        if shared is not None:
            log.info(
                "job %d pipeline %d shares DALI pipeline %d %r",
                job.job_id,
                pipeline_id,
                shared.instance_id,
                shared.name,
            )
            with self._lock:
                self._pids.setdefault(shared.instance_id, set()).add(job.pid)
                # A pipeline that holds runs now may run this job's next: it is named at once.
                self._mark(shared.instance_id)
            shared.join(member, on_built)
        else:
            self._new_instance(job, plan, member, on_built, threads, cohort=bool(request.cohort))
        job.pipelines[pipeline_id] = member
        return member

    def _new_instance(
        self,
        job: Job,
        plan: Plan,
        member: Member,
        on_built: Callable[[PipelineSpec | PipelineBuildError], None],
        max_threads: int,
        *,
        cohort: bool = False,
    ) -> None:
        shared = plan.key is not None
        run_batches = self._sharing.run_batches if shared else 1
        if cohort and not run_batches:
            # Under auto, a pipeline a cohort member starts runs one batch a run: its members
            # submit the same batches, each run once for all, so a run of several would only
            # pack one member's prefetched batches, and DALI keeps buffers for the largest run
            # it has seen (4 jobs, batch 32: the daemon 148 MiB smaller, samples/s the same;
            # bench/README.md, "Where a 4-job cohort's memory goes").
            run_batches = 1
        threads = self._sharing.threads if shared else 0
        pinned = self._sharing.instances or None
        start, most = 1, pinned or MAX_INSTANCES
        if (
            shared
            and pinned is None
            and self._device_id is None
            and threads
            and plan.known_shareable
            and not cohort
        ):
            # Note [Two instances on a CPU]: within the threads and the one place among the
            # daemon's pipelines that the pipeline holds (budget.py).
            start, threads = cpu_start(min(threads, max_threads))
            most = start
        with self._lock:
            instance_id = self._next_instance_id
            self._next_instance_id += 1
            self._pids[instance_id] = {job.pid}
        self.budget.add(instance_id, max_threads, job.uid)
        controller = None
        if shared:
            controller = InstanceController(pinned=pinned, max_instances=most, start=start)
        settings = ExecutorSettings(
            instance_id,
            plan.name,
            shared=shared,
            run_batches=run_batches,
            private_reason=plan.why_private,
            max_image_pixels=job.limits.max_image_pixels,
            device_id=self._device_id,
            solo_runs=PROBATION_RUNS if plan.probation else 0,
        )
        parts = ExecutorParts(
            functools.partial(
                plan.make_runner,
                run_batches=run_batches,
                num_threads=threads or None,
                max_threads=max_threads,
            ),
            scheduler=self._scheduler,
            stream=self._streams() if shared else None,
            controller=controller,
            room=self.budget,
            on_run=functools.partial(self._on_run, instance_id, plan.flight_key, plan.name),
            on_empty=self._forget,
            on_private=self._unshare,
            gate=self.gate,
            on_cleared=functools.partial(self._cleared, plan.flight_key, job.pid),
        )
        executor = PipelineExecutor(settings, parts, member, on_built)
        with self._lock:
            self.instances[instance_id] = executor
            if plan.key is not None:
                self._shared[plan.key] = executor

    def status(self) -> tuple[PipelineStatus, ...]:
        """Every pipeline in the daemon, for ``dalid status``."""
        with self._lock:
            instances = sorted(self.instances.items())
        return tuple(executor.status() for _, executor in instances)

    def _on_run(self, instance_id: int, key: bytes, name: str, running: bool) -> None:
        """From an executor's thread: its pipeline has runs in DALI, or none. The recorder's
        slot is written only when that changes (or, while it runs, its jobs do: ``start``)."""
        if self._recorder is None or not key:
            return
        with self._lock:
            if running == (instance_id in self._marked):
                return
            if running:
                self._marked[instance_id] = (key, name)
                self._mark(instance_id)
            else:
                del self._marked[instance_id]
                self._recorder.idle(instance_id)

    def _mark(self, instance_id: int) -> None:
        """Writes the recorder's slot of a pipeline marked running, with its jobs' trainers
        now (under ``_lock``)."""
        marked = self._marked.get(instance_id)
        if self._recorder is not None and marked is not None:
            key, name = marked
            executor = self.instances.get(instance_id)  # its runs solo: on probation
            solo = executor is not None and executor.solo
            self._recorder.running(
                instance_id, key, self._pids.get(instance_id, ()), name, solo=solo
            )

    def _cleared(self, key: bytes, pid: int) -> None:
        if self._recorder is not None:
            self._recorder.cleared(key, pid)

    def _suspected(self, key: bytes, job: Job) -> bool:
        """Refuses a graph that was running for this trainer when the last daemon died, where
        the crash was its own; whether it is on probation (flight.py)."""
        suspect = self._recorder.suspected(key, job.pid) if self._recorder else None
        if suspect is not None and suspect.standing is Standing.REFUSED:
            raise RequestRefused(ErrorCode.INVALID_PIPELINE, refusal(suspect))
        return suspect is not None

    def _forget(self, executor: PipelineExecutor) -> None:
        """The last member of ``executor`` left: it takes no more registrations."""
        self.budget.forget(executor.instance_id)
        with self._lock:
            self.instances.pop(executor.instance_id, None)
            self._pids.pop(executor.instance_id, None)
            for key, shared in list(self._shared.items()):
                if shared is executor:
                    del self._shared[key]

    def _unshare(self, executor: PipelineExecutor) -> None:
        """``executor`` runs no mixed runs: later registrations get pipelines of their own."""
        with self._lock:
            for key, shared in list(self._shared.items()):
                if shared is executor:
                    del self._shared[key]

    def _on_built(
        self,
        job: Job,
        member: Member,
        request: Registration,
        request_id: int | None,
        result: PipelineSpec | PipelineBuildError,
    ) -> None:
        # Runs in the executor's thread (or the I/O thread, for a built pipeline that a
        # registration joins): the reply leaves through the outbox.
        if isinstance(result, PipelineSpec):
            log.info(
                "job %d registered pipeline %d %r (on DALI pipeline %d)",
                job.job_id,
                member.pipeline_id,
                result.name,
                member.executor.instance_id if member.executor is not None else 0,
            )
            reply: Message = PipelineRegistered(
                member.pipeline_id,
                input_names=result.input_names,
                num_outputs=result.num_outputs,
                max_batch_size=result.max_batch_size,
                path_inputs=result.path_inputs,
            )
        else:
            log.info("job %d: pipeline %r not built: %s", job.job_id, request.name, result)
            reply = Error(result.code, str(result), op=request.OP)
        self._push(job.trainer, reply, request_id)

    def _plan(self, job: Job, request: Registration) -> Plan:
        """How to build the registered pipeline, and with whom it may share."""
        why_private = self._why_private(request)
        if isinstance(request, RegisterPipeline):
            if request.max_batch_size > self._max_batch_size:
                raise RequestRefused(
                    ErrorCode.INVALID_PIPELINE,
                    f"max_batch_size {request.max_batch_size} is over this daemon's limit of "
                    f"{self._max_batch_size}",
                )
            spec = PipelineSpec.from_message(request)
            if self._legacy:
                spec = dataclasses.replace(spec, exec_dynamic=False)
            key: Hashable = None
            # Before DALI sees the graph: only operators of the allow-list, and a graph that
            # cannot be read is not built (it fails closed).
            try:
                graph = read_graph(spec.serialized)
                self._operators.check(operator.schema for operator in graph.operators)
                # Outputs larger than a job can hold, before DALI allocates them.
                check_sizes(
                    graph,
                    spec.max_batch_size,
                    job.limits.pool_bytes,
                    job.limits.max_image_pixels,
                )
            except (UnreadablePipeline, OperatorRefused) as error:
                raise RequestRefused(
                    ErrorCode.INVALID_PIPELINE, f"the pipeline is not served: {error}"
                ) from None
            flight_key = graph_key("serialized", graph.key)
            probation = self._suspected(flight_key, job)
            if not spec.name and graph.origin:
                spec = dataclasses.replace(spec, name=graph.origin)
            why_private = why_private or _ON_PROBATION * probation or graph.unshareable()
            cohort_key: Hashable = (
                "serialized",
                graph.key,
                spec.input_names,
                spec.num_outputs,
                spec.max_batch_size,
            )
            if not why_private:
                key = (
                    "serialized",
                    graph.key,
                    spec.input_names,
                    spec.num_outputs,
                    spec.max_batch_size,
                    spec.exec_dynamic,
                )
            runner = functools.partial(PipelineRunner, spec, self._device_id)
            return Plan(runner, key, why_private, spec.name, flight_key, cohort_key, probation)
        parameters = json.loads(request.parameters)
        build_arguments = {
            name: getattr(request, name)
            for name in ("batch_size", "num_threads", "prefetch_queue_depth", "seed")
            if getattr(request, name) is not None
        }
        build_arguments["device_id"] = self._device_id
        if self._legacy:
            build_arguments["exec_dynamic"] = False
        try:
            # Read once, now: a reload meanwhile does not change what this registration builds.
            entry = self._repository.current.get(request.name)
        except KeyError as error:
            raise RequestRefused(ErrorCode.UNKNOWN_PIPELINE, error.args[0]) from None
        flight_key = graph_key("named", request.name, json.dumps(parameters, sort_keys=True))
        probation = self._suspected(flight_key, job)
        why_private = why_private or _ON_PROBATION * probation
        definition = functools.partial(entry.function, **build_arguments, **parameters)
        make_runner = functools.partial(
            PipelineRunner.from_definition,
            request.name,
            definition,
            self._device_id,
            self._max_batch_size,
            on_error=request.on_error,
            operators=self._operators,
        )
        named_cohort: Hashable = (
            "named",
            request.name,
            json.dumps(parameters, sort_keys=True),
            request.batch_size,
        )
        if why_private:
            return Plan(
                make_runner, None, why_private, request.name, flight_key, named_cohort, probation
            )
        # One definition of the repository (a reload makes another), called alike; whether its
        # operators allow sharing is known once it is built (PipelineExecutor).
        named_key = (
            "named",
            entry.function,
            json.dumps(parameters, sort_keys=True),
            request.batch_size,
            request.prefetch_queue_depth,
        )
        return Plan(
            make_runner,
            named_key,
            "",
            request.name,
            flight_key,
            named_cohort,
            known_shareable=False,
        )

    def _why_private(self, request: Registration) -> str:
        if not self._sharing.enabled:
            return "pipeline sharing is off (dalid serve --share-pipelines no)"
        if request.deterministic:
            return "deterministic: the trainer orders its batches"
        if not request.share_runs:
            return "its job asked for runs of its own (share_runs=False)"
        return ""


_ON_PROBATION = "on probation: it was running beside other trainers' runs when a daemon died"
