"""A training job's session with a daemon: register pipelines, receive outputs as tensors."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dalid.protocol import (
    MAX_EARLIER_JOBS,
    BatchAccepted,
    BatchFailed,
    BatchReady,
    Device,
    EarlierJob,
    EarlierPipeline,
    Envelope,
    Error,
    ErrorCode,
    Limits,
    OnError,
    PipelineRegistered,
    RegisterNamedPipeline,
    RegisterPipeline,
    ReleaseRegions,
    Role,
    ScheduleBatch,
    SubmitBatch,
    TrainerProgress,
    parse_device,
    socket_path,
)

from .badsamples import SampleReport, follow_bad_samples, locate
from .connection import Connection, no_daemon_message
from .copies import copied_tensor
from .cuda import CudaMappings, TorchDevice, local_device
from .errors import (
    BatchError,
    DaemonStopped,
    DaemonUnavailable,
    DeviceMismatch,
    InputError,
    ProtocolMismatch,
    RequestError,
)
from .launcher import start_daemon
from .memory import SlabMappings
from .named import RepositoryPipeline
from .options import check_job_options
from .paths import path_inputs, resolve_paths
from .refs import DALIPipelineRunRef
from .structure import replace_refs
from .transform import Proxy, ProxyTarget, batch_inputs, worker_links

log = logging.getLogger("dalid.client")

# How often the trainer tells the daemon how long it has waited for batches (for `dalid status`).
PROGRESS_INTERVAL_S = 1.0

# A batch this late usually means the daemon's output pool is full of buffers the trainer still
# holds through live tensors; say so once.
SLOW_BATCH_WARNING_S = 30.0
# How many times in a row one call may find the daemon gone and reconnect before it gives up.
MAX_RECONNECTS = 5

# Note [Daemon restarts]
# ~~~~~~~~~~~~~~~~~~~~~~
# A daemon keeps nothing across a restart: the new one on the socket knows none of the old
# one's jobs, pipelines, batch ids or regions. What each process holds, and what it does when
# it finds the daemon gone (the connection notices within a second where the daemon's pid can
# be watched, a few seconds otherwise, and raises DaemonUnavailable):
#
# 1. A worker process submits batches and hands the trainer a DALIPipelineRunRef naming the
#    batch, the job its proxy names (``job_token``, unique to one job of one daemon instance)
#    and the job that accepted the batch (``accepted_by``, the token of its link's welcome).
#    With reconnect=True the ref also carries the batch's inputs, and keeps them until the
#    trainer has delivered its outputs. A worker that finds the daemon gone leaves the batch
#    unsent (``batch_id`` None) and drops that job's link; the trainer submits it.
# 2. The trainer's session, finding the daemon gone, abandons that daemon's generation as a
#    whole: its connection (no goodbye), its slab mappings and the results it had received
#    but not yet delivered. Tensors already delivered stay valid: their pages stay mapped
#    until the tensors are freed (the new daemon unlinks the old segments' names), and their
#    releases go to the abandoned mappings, never to the new daemon, whose region ids and
#    slabs are unrelated. Then it connects again (a new job), registers every pipeline again
#    and points the proxies it made at the new registrations (workers started from then on
#    submit to the new job). Its hello names every job it had on earlier daemons
#    (``earlier_jobs``), and each registration the pipeline's id in each of them
#    (``earlier_ids``): the new daemon knows nothing of them, so the trainer, which outlives
#    them all, is what carries them from daemon to daemon.
# 3. When the trainer delivers a batch that another job accepted (one of an abandoned
#    daemon), or no job at all, it submits the batch again from the inputs the ref carries,
#    under the pipeline's new id.
#    A batch is delivered once: its ref is turned into tensors once, and results that came
#    from the old daemon but were not yet delivered are dropped with it, so nothing arrives
#    twice and nothing is lost.
# 4. Workers that were running at the restart hold an earlier job in their pickled proxy. A
#    worker tries that job again with a new hello at its next batch, and while hellos fail at
#    most once per REJOIN_EVERY_S (each waits at most REJOIN_HELLO_TIMEOUT_S). The new daemon
#    welcomes it
#    into the trainer's new job once the trainer has reconnected, and runs its batches, which
#    name the pipeline's earlier id, on the pipeline registered again; the welcome's token
#    becomes the refs' ``accepted_by``, so the trainer waits for those batches instead of
#    submitting them again. Until then (daemon still down, trainer not reconnected or the
#    pipeline not registered again yet) its batches reach the trainer unsent, as in point 1.
#    GPU outputs follow the same steps; that path has not run on a GPU.


class _Resources:
    """What a session owns, closed once, by ``Session.close`` or by a finalizer at GC.

    GPU outputs: ``cuda_index`` is the daemon's GPU as this process numbers it (None until
    known); ``cuda`` is made when the first GPU output arrives, so CPU users never touch CUDA.
    """

    def __init__(
        self, connection: Connection, mappings: SlabMappings, cuda_index: int | None
    ) -> None:
        self.connection = connection
        self.mappings = mappings
        self.cuda_index = cuda_index
        self.cuda: CudaMappings | None = None
        # Retired slabs of a GPU daemon to report unmapped, before any GPU output was mapped.
        self.never_mapped: list[str] = []

    def gpu(self) -> CudaMappings:
        if self.cuda is None:
            uuid = self.connection.welcome.device_uuid
            if not uuid:
                raise DeviceMismatch("the daemon sent a GPU output but named no GPU in its welcome")
            index = self.cuda_index if self.cuda_index is not None else local_device(uuid)
            self.cuda = CudaMappings(TorchDevice(index))
        return self.cuda

    def abandon(self) -> None:
        """Lets go of a daemon that is gone: no goodbye, and nothing more is sent to it.

        Mappings close as at the end of a job: tensors that view them keep them (Note [Daemon
        restarts]); their releases are dropped with this object.
        """
        welcome = self.connection.welcome
        worker_links.close_job(self.connection.path, welcome.job_id, welcome.job_token, False)
        self.connection.abort()
        self.mappings.close()
        if self.cuda is not None:
            self.cuda.close_mappings()
            self.cuda.close()

    def close(self) -> None:
        welcome = self.connection.welcome
        worker_links.close_job(self.connection.path, welcome.job_id, welcome.job_token)
        # GPU slabs are unmapped before the goodbye, which names those tensors still view
        # (Note [GPU output lifetime] in dalid.server.cuda).
        kept = self.cuda.close_mappings() if self.cuda is not None else ()
        self.connection.close(kept_slabs=kept)
        self.mappings.close()
        if self.cuda is not None:
            self.cuda.close()


class _Progress:
    """How long the trainer has waited for batches, reported to the daemon now and then."""

    def __init__(self) -> None:
        self.waited = 0.0
        self.batches = 0
        self.reported_at = 0.0

    def report(self, connection: Connection, waiting_for: float = 0.0) -> None:
        """Sends the totals if the last report is old enough; ``waiting_for`` the wait so far."""
        now = time.monotonic()
        if now - self.reported_at < PROGRESS_INTERVAL_S:
            return
        self.reported_at = now
        connection.notify(TrainerProgress(self.waited + waiting_for, self.batches))


@dataclass
class _Registration:
    """A pipeline this session registered, kept to register it again with a new daemon."""

    request: RegisterPipeline | RegisterNamedPipeline
    deterministic: bool
    # The daemon's answer to the latest registration: the pipeline as it built it.
    registered: PipelineRegistered | None = None
    # The proxies made for it, pointed at each new registration.
    proxies: weakref.WeakSet[Proxy] = field(default_factory=weakref.WeakSet)


def _graph(pipeline: Any) -> Any:
    """The pipeline with its Python graph built, without building the pipeline itself.

    Building would need the pipeline's device in the trainer (a GPU pipeline needs CUDA there);
    the graph is all the client needs. DALI's own proxy reads the same private attributes.
    """
    if getattr(pipeline, "_deserialized", False):
        raise InputError(
            "the pipeline was deserialized, so its external_source names are unknown: pass the "
            "pipeline object built from its definition"
        )
    if not pipeline._py_graph_built:
        pipeline._build_graph()
    return pipeline


def external_source_names(pipeline: Any) -> list[str]:
    """The names of a pipeline's external_source operators, in definition order."""
    from nvidia.dali.external_source import ExternalSource

    return [op.name for op in _graph(pipeline)._ops if isinstance(op._op, ExternalSource)]


def output_count(pipeline: Any) -> int:
    """How many outputs the pipeline's graph returns."""
    return int(_graph(pipeline)._num_outputs)


def _check_pipeline(pipeline: Any) -> None:
    from nvidia.dali import Pipeline

    if not isinstance(pipeline, Pipeline):
        raise InputError(f"expected an NVIDIA DALI pipeline, got {type(pipeline).__name__}")


def pipeline_device(pipeline: Any) -> Device:
    """The device a pipeline was defined for: its device_id, or ``"cpu"`` when it has none."""
    _check_pipeline(pipeline)
    return "cpu" if pipeline.device_id is None else int(pipeline.device_id)


class Session:
    """A job connected to the daemon for one device. Use as a context manager or ``close()``.

    CPU outputs arrive as CPU tensors that view the daemon's shared memory. GPU outputs (from a
    daemon started with ``--device N``) arrive as CUDA tensors that view the daemon's device
    memory, on this process's device with the daemon GPU's UUID, ready in the order of the
    stream that was current when they were produced (it waits on the daemon, the host does
    not). Each region goes back to the daemon when the last tensor viewing it is
    garbage-collected; a GPU region once the work queued on that stream until then has run.

    With ``reconnect``, a daemon that is killed or restarted does not end the job: the session
    connects to the daemon that comes back on the socket (waiting up to ``connect_timeout``),
    registers its pipelines again and submits again every batch not yet delivered, so none is
    lost or delivered twice (Note [Daemon restarts]). Batches then carry their inputs from the
    DataLoader workers to the trainer, a copy that costs little beside decoding them.
    """

    def __init__(
        self,
        device: Device = "cpu",
        socket: str | os.PathLike[str] | None = None,
        autostart: bool = True,
        name: str | None = None,
        connect_timeout: float = 60.0,
        *,
        weight: float = 1.0,
        memory_bytes: int | None = None,
        max_inflight_batches: int | None = None,
        reconnect: bool = False,
    ) -> None:
        check_job_options(
            name=name,
            weight=weight,
            memory_bytes=memory_bytes,
            max_inflight_batches=max_inflight_batches,
            reconnect=reconnect,
        )
        try:
            self.device = parse_device(device)
        except ValueError as error:
            raise InputError(str(error)) from None
        self.socket = socket_path(self.device, socket)
        self.reconnect = reconnect
        self._autostart = autostart
        self._connect_timeout = connect_timeout
        self._name = name or f"pid {os.getpid()}"
        # Results that arrived while waiting for another; filled by the connection. Neither it
        # nor the connection may hold the session itself, or the finalizer would never run.
        self._results: dict[int, BatchReady | BatchFailed] = {}
        self._registrations: list[_Registration] = []
        # Every (job_token, pipeline_id) this session was given, in any daemon generation.
        self._pipeline_keys: dict[tuple[str, int], _Registration] = {}
        # The jobs this session had on daemons it reconnected away from, oldest first, named
        # to each new daemon so that workers holding them join the new job.
        self._earlier_jobs: list[EarlierJob] = []
        self.reconnects = 0
        # Batches of DataLoader workers that this session submitted itself, from the inputs
        # their refs carry: those of a daemon that died, and those a worker could not send.
        self.submitted_by_trainer = 0
        self._job_request = JobRequest(weight, memory_bytes or 0, max_inflight_batches or 0)
        self._progress = _Progress()
        # Bad samples skipped or replaced in the batches of the last produce_data call.
        self.last_bad_samples: list[SampleReport] = []
        self._resources = self._open(
            autostart_connect(
                self.socket,
                self.device,
                autostart=autostart,
                connect_timeout=connect_timeout,
                name=self._name,
                on_push=functools.partial(_keep_result, self._results),
                job=self._job_request,
            )
        )
        self._finalizer = weakref.finalize(self, self._resources.close)

    @staticmethod
    def _open(connection: Connection) -> _Resources:
        """The resources of one daemon generation, owning ``connection`` from here on."""
        try:
            cuda_index = _daemon_gpu(connection.welcome.device_uuid)
        except DeviceMismatch:
            connection.close()
            raise
        return _Resources(connection, SlabMappings(), cuda_index)

    # --- properties -----------------------------------------------------------------------------

    @property
    def job_id(self) -> int:
        return self._resources.connection.welcome.job_id

    @property
    def daemon_pid(self) -> int:
        return self._resources.connection.welcome.daemon_pid

    @property
    def limits(self) -> Limits:
        return self._resources.connection.welcome.limits

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def slabs_opened(self) -> int:
        """How many slabs this session has mapped, CPU and GPU (each is mapped once)."""
        cuda = self._resources.cuda
        return self._resources.mappings.opened + (cuda.opened if cuda is not None else 0)

    @property
    def events_opened(self) -> int:
        """How many of the daemon's batch events this session has opened (each once)."""
        cuda = self._resources.cuda
        return cuda.events_opened if cuda is not None else 0

    @property
    def live_regions(self) -> int:
        """Output regions that tensors still view, CPU and GPU."""
        cuda = self._resources.cuda
        return self._resources.mappings.live_regions + (
            cuda.live_regions if cuda is not None else 0
        )

    # --- API ------------------------------------------------------------------------------------

    def proxy(self, pipeline: Any, deterministic: bool = False, on_error: str = "raise") -> Proxy:
        """Registers ``pipeline`` with the daemon and returns its picklable proxy callable.

        ``pipeline`` is a DALI pipeline, or a pipeline of the daemon's repository: a
        :class:`RepositoryPipeline` (``named_pipeline(name, batch_size=..., **parameters)``),
        or just its name. With ``deterministic`` a batch runs only when the trainer asks for
        its outputs, in the order the trainer asks, so random operators repeat run to run.

        ``on_error`` says what happens to a batch with bad samples (corrupt or unsupported
        data, or images over the daemon's ``--max-image-pixels``): ``"raise"`` raises
        :class:`BatchError` naming them; ``"skip"`` delivers the batch without them, and
        without their rows of every other per-sample field; ``"replace"`` delivers it with each
        replaced by a good sample of the batch. Skipped and replaced samples are logged and
        listed in :attr:`last_bad_samples`; the other per-sample fields of the batch (labels)
        follow, see :meth:`produce_data`.
        """
        return self._register(pipeline, deterministic, on_error=on_error)

    def _register(
        self,
        pipeline: Any,
        deterministic: bool,
        proxy: Proxy | None = None,
        on_error: str = "raise",
    ) -> Proxy:
        """Registers ``pipeline``; ``proxy``, when given, is pointed at it instead of a new one."""
        try:
            policy = OnError(on_error)
        except ValueError:
            raise InputError(
                f"on_error must be one of {[p.value for p in OnError]}, got {on_error!r}"
            ) from None
        if isinstance(pipeline, str):
            pipeline = RepositoryPipeline(pipeline)
        request: RegisterPipeline | RegisterNamedPipeline
        if isinstance(pipeline, RepositoryPipeline):
            request = dataclasses.replace(pipeline.request(), on_error=policy)
        else:
            request = self._serialized_request(pipeline, policy)
        registration = _Registration(request, deterministic)
        self._with_reconnect(lambda: self._register_now(registration))
        self._registrations.append(registration)
        target = self._target_of(registration)
        if proxy is None:
            proxy = Proxy(target)
        else:
            proxy.retarget(target)
        registration.proxies.add(proxy)
        return proxy

    @staticmethod
    def _serialized_request(pipeline: Any, policy: OnError) -> RegisterPipeline:
        _check_pipeline(pipeline)
        names = external_source_names(pipeline)
        if not names:
            raise InputError(
                "the pipeline has no external_source: dalid feeds pipelines through "
                "fn.external_source(name=...) inputs"
            )
        depth = pipeline.prefetch_queue_depth
        if isinstance(depth, dict):
            depth = max(depth.values())
        return RegisterPipeline(
            serialized=memoryview(pipeline.serialize()),
            input_names=tuple(names),
            num_outputs=output_count(pipeline),
            max_batch_size=pipeline.max_batch_size,
            num_threads=pipeline.num_threads,
            prefetch_queue_depth=int(depth),
            seed=pipeline.seed,
            exec_dynamic=bool(pipeline.exec_dynamic),
            name=getattr(pipeline, "_name", None) or "",
            on_error=policy,
            path_inputs=path_inputs(pipeline),
        )

    def _register_now(self, registration: _Registration) -> None:
        """Registers with the daemon connected now, naming the ids the pipeline had in the
        earlier jobs this session names at hello."""
        earlier = {job.job_token for job in self._earlier_jobs}
        request = dataclasses.replace(
            registration.request,
            earlier_ids=tuple(
                EarlierPipeline(token, pipeline_id)
                for (token, pipeline_id), known in self._pipeline_keys.items()
                if known is registration and token in earlier
            ),
        )
        reply = self._connection.request(request)
        assert isinstance(reply, PipelineRegistered)
        registration.registered = reply
        token = self._connection.welcome.job_token
        self._pipeline_keys[(token, reply.pipeline_id)] = registration

    def _target_of(self, registration: _Registration) -> ProxyTarget:
        """Where a proxy sends its batches: the pipeline as the daemon built it."""
        welcome = self._connection.welcome
        registered = registration.registered
        assert registered is not None
        return ProxyTarget(
            socket=self.socket,
            device=self.device,
            job_id=welcome.job_id,
            job_token=welcome.job_token,
            pipeline_id=registered.pipeline_id,
            input_names=registered.input_names,
            num_outputs=registered.num_outputs,
            max_batch_size=registered.max_batch_size,
            deterministic=registration.deterministic,
            reconnect=self.reconnect,
            path_inputs=registered.path_inputs,
            working_directory=os.getcwd(),
        )

    def produce_data(self, obj: Any) -> Any:
        """``obj`` with every batch reference replaced by its tensor (nested structures too).

        Where bad samples were skipped or replaced (``on_error``), every other per-sample field
        of ``obj`` gets the same treatment (see :func:`follow_bad_samples`), so labels stay aligned
        with outputs: a skipped sample's label is dropped, a replaced one's is the label of the
        sample that replaced it.
        """
        return self.produce(obj)

    def produce(
        self, obj: Any, *, step: int | None = None, indices: list[int] | None = None
    ) -> Any:
        """:meth:`produce_data` for dalid's DataLoader, which names the batch's ``step`` (as
        ``enumerate(loader)`` counts) and the dataset ``indices`` of its samples: bad samples
        and batch errors are then told by those, not by the daemon's batch ids."""
        reports: list[SampleReport] = []
        self.last_bad_samples = []
        resolved: list[tuple[DALIPipelineRunRef, tuple[torch.Tensor, ...]]] = []

        def resolve(runs: list[DALIPipelineRunRef]) -> dict[int, tuple[torch.Tensor, ...]]:
            produced = self._outputs_of(runs, reports)
            resolved.extend((run, produced[id(run)]) for run in runs)
            return produced

        try:
            produced = follow_bad_samples(replace_refs(obj, resolve), resolved, reports)
        except BatchError as error:
            if step is not None or indices is not None:
                error.locate(step, indices)
            raise
        self.last_bad_samples = locate(reports, step, indices)
        for report in self.last_bad_samples:
            log.warning("%s", report)
        return produced

    def outputs(self, run: DALIPipelineRunRef) -> tuple[torch.Tensor, ...]:
        """The outputs of one batch, waiting for them (and scheduling it if deferred)."""
        reports: list[SampleReport] = []
        outputs = self._outputs_of([run], reports)[id(run)]
        for report in reports:
            log.warning("%s", report)
        return outputs

    def close(self) -> None:
        """Ends the job: the daemon frees its pipelines; live tensors stay valid. Idempotent."""
        if self._finalizer.alive:
            self._flush_releases()
        self._finalizer()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"job {self.job_id}"
        return f"<dalid Session {self.socket} {state}>"

    # --- internals ------------------------------------------------------------------------------

    @property
    def _connection(self) -> Connection:
        if self.closed:
            raise DaemonUnavailable("this dalid session is closed")
        return self._resources.connection

    def _with_reconnect(self, action: Callable[[], Any]) -> Any:
        """``action()``; with ``reconnect``, again after each reconnection to a new daemon."""
        gone = False
        for attempt in range(MAX_RECONNECTS + 1):
            try:
                if gone:
                    self._reconnect_now()
                return action()
            except DaemonUnavailable as error:
                if (
                    not self.reconnect
                    or isinstance(error, ProtocolMismatch | DaemonStopped)
                    or self.closed
                ):
                    raise  # a stopped daemon is not restarted: nothing to wait for
                if attempt == MAX_RECONNECTS:
                    raise DaemonUnavailable(
                        f"{error} (gave up after {MAX_RECONNECTS} reconnections in a row)"
                    ) from error
                log.warning("%s: reconnecting", error)
                gone = True
        raise AssertionError("unreachable")

    def _reconnect_now(self) -> None:
        """Abandons the daemon that is gone and starts over with the one on the socket now."""
        welcome = self._resources.connection.welcome
        abandoned = EarlierJob(welcome.job_id, welcome.job_token)
        if abandoned not in self._earlier_jobs:
            # Past the limit the oldest goes: its workers (persistent ones, started that long
            # ago) then leave their batches to this session.
            self._earlier_jobs = [*self._earlier_jobs, abandoned][-MAX_EARLIER_JOBS:]
        self._finalizer.detach()
        self._resources.abandon()
        self._results.clear()
        deadline = time.monotonic() + self._connect_timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                connection = autostart_connect(
                    self.socket,
                    self.device,
                    autostart=self._autostart,
                    connect_timeout=max(remaining, 1.0),
                    name=self._name,
                    on_push=functools.partial(_keep_result, self._results),
                    hello_timeout=min(max(remaining, 1.0), 5.0),
                    job=self._job_request,
                    earlier_jobs=tuple(self._earlier_jobs),
                )
                break
            except (DaemonUnavailable, RequestError) as error:
                # A daemon that lives on (it stopped answering pings for a while) may not have
                # ended our abandoned job yet, which holds an identity the hello claims; it
                # does once it notices that job's connection closed.
                if isinstance(error, RequestError) and error.code is not ErrorCode.JOB_CLAIMED:
                    raise
                if isinstance(error, ProtocolMismatch) or time.monotonic() >= deadline:
                    raise DaemonUnavailable(
                        f"no dalid daemon came back on {self.socket} within "
                        f"{self._connect_timeout:.0f} s: {error}"
                    ) from error
                time.sleep(0.2)
        self._resources = self._open(connection)
        self._finalizer = weakref.finalize(self, self._resources.close)
        self.reconnects += 1
        log.warning(
            "reconnected to the dalid daemon on %s (pid %d), job %d",
            self.socket,
            self.daemon_pid,
            self.job_id,
        )
        for registration in self._registrations:
            self._register_now(registration)
            for proxy in registration.proxies:
                proxy.retarget(self._target_of(registration))

    def _outputs_of(
        self, runs: Iterable[DALIPipelineRunRef], reports: list[SampleReport]
    ) -> dict[int, tuple[torch.Tensor, ...]]:
        """Tensors for each run (keyed by ``id(run)``), in the order the runs are given; the
        bad samples they were delivered without, or with replaced, go to ``reports``."""
        runs = list(runs)
        for run in runs:
            if run.batch_id is None and not (self.reconnect and run.call_args):
                raise InputError(
                    "a batch reference that was never submitted: collate the proxy's sample "
                    "references (torch's default collate does) before produce_data"
                )
            if (run.job_token, run.pipeline_id) not in self._pipeline_keys:
                raise InputError(
                    f"batch {run.batch_id} belongs to job {run.job_id}, not to this session's "
                    f"job {self.job_id}"
                )
        start = len(reports)

        def attempt() -> dict[int, tuple[torch.Tensor, ...]]:
            del reports[start:]  # an attempt cut short by a reconnection reports nothing
            return self._deliver(runs, reports)

        produced: dict[int, tuple[torch.Tensor, ...]] = self._with_reconnect(attempt)
        for run in runs:
            run.call_args = {}  # delivered: the inputs kept for a resubmission can go
        return produced

    def _deliver(
        self, runs: list[DALIPipelineRunRef], reports: list[SampleReport]
    ) -> dict[int, tuple[torch.Tensor, ...]]:
        token = self._connection.welcome.job_token
        for run in runs:
            # Accepted by another job: one of a daemon that is gone (a worker that rejoined
            # this job after a restart got this job's token in its welcome).
            if run.batch_id is None or run.accepted_by != token:
                self._submit_again(run)
        for run in runs:
            if not run.is_scheduled:
                self._connection.request(ScheduleBatch(run.batch_id))  # type: ignore[arg-type]
                run.is_scheduled = True
        produced: dict[int, tuple[torch.Tensor, ...]] = {}
        for run in runs:
            result = self._wait(run.batch_id)  # type: ignore[arg-type]
            if isinstance(result, BatchFailed):
                raise BatchError(
                    result.code,
                    result.message,
                    result.batch_id,
                    result.pipeline_id,
                    result.bad_samples,
                )
            self._retire(result.retired_slabs)
            produced[id(run)] = self._tensors(result)
            reports.extend(
                SampleReport(
                    result.batch_id,
                    result.pipeline_id,
                    bad.position,
                    bad.message,
                    None if bad.replaced_by < 0 else bad.replaced_by,
                )
                for bad in result.bad_samples
            )
        return produced

    def _submit_again(self, run: DALIPipelineRunRef) -> None:
        """Submits a batch of an abandoned daemon (or one a worker could not send) to this one."""
        registration = self._pipeline_keys[(run.job_token, run.pipeline_id)]
        if not run.call_args:
            # Not DaemonUnavailable: reconnecting again would not bring the inputs back.
            raise InputError(
                f"batch {run.batch_id} was lost with the daemon on {self.socket} and its inputs "
                "are gone: it was delivered already, or its proxy was made by another session"
            )
        registered = registration.registered
        assert registered is not None
        call_args, unreadable = resolve_paths(run.call_args, registered.path_inputs, os.getcwd())
        inputs = batch_inputs(registered.input_names, call_args)
        pipeline_id = registered.pipeline_id
        request = SubmitBatch(
            pipeline_id, inputs, deferred=run.deterministic, unreadable=unreadable
        )
        reply = self._connection.request(request)
        assert isinstance(reply, BatchAccepted)
        welcome = self._connection.welcome
        run.job_id, run.job_token = welcome.job_id, welcome.job_token
        run.pipeline_id, run.batch_id = pipeline_id, reply.batch_id
        run.accepted_by = welcome.job_token
        run.is_scheduled = not run.deterministic
        self.submitted_by_trainer += 1

    def _tensors(self, result: BatchReady) -> tuple[torch.Tensor, ...]:
        resources = self._resources
        stream = None
        tensors = []
        for index, output in enumerate(result.outputs):
            if result.copies:  # Note [Private copies] in dalid.server.copies
                tensor = copied_tensor(output, result.copies[index])
                if output.device == "cuda":
                    tensor = tensor.to(resources.gpu().device.torch_device)  # type: ignore[attr-defined]
                tensors.append(tensor)
                continue
            if output.device == "cpu":
                try:
                    tensors.append(resources.mappings.tensor(output))
                except FileNotFoundError:
                    # Only a daemon that died, its segments removed by its successor, loses
                    # a slab it has just named (Note [Output buffer lifetime], point 6).
                    raise resources.connection.gone_error(
                        f"its shared memory {output.slab} was removed"
                    ) from None
                continue
            cuda = resources.gpu()
            if stream is None:
                # Once per batch: the current stream waits for the daemon's copies.
                stream = cuda.begin_batch(result.event)
            tensors.append(cuda.tensor(output, stream))
        return tuple(tensors)

    def _retire(self, names: tuple[str, ...]) -> None:
        resources = self._resources
        resources.mappings.retire(names)
        if names and resources.connection.welcome.device_uuid:
            if resources.cuda is not None:
                resources.cuda.retire(names)
            else:
                resources.never_mapped.extend(names)

    def _wait(self, batch_id: int) -> BatchReady | BatchFailed:
        progress = self._progress
        progress.batches += 1
        result = self._results.pop(batch_id, None)
        if result is not None:
            progress.report(self._connection)
            return result

        def is_result(envelope: Envelope) -> bool:
            message = envelope.message
            return isinstance(message, BatchReady | BatchFailed) and message.batch_id == batch_id

        started = time.monotonic()
        warned = False

        def idle() -> None:
            nonlocal warned
            self._flush_releases()
            progress.report(self._connection, time.monotonic() - started)
            if not warned and time.monotonic() - started > SLOW_BATCH_WARNING_S:
                warned = True
                log.warning(
                    "batch %d has not arrived after %.0f s; this job still holds %d output "
                    "buffers through live tensors. If you keep outputs across steps, keep "
                    "copies (tensor.clone()) so the daemon can reuse its buffers.",
                    batch_id,
                    SLOW_BATCH_WARNING_S,
                    self.live_regions,
                )

        envelope = self._connection.receive_until(is_result, None, idle=idle)
        assert envelope is not None and isinstance(envelope.message, BatchReady | BatchFailed)
        progress.waited += time.monotonic() - started
        progress.report(self._connection)
        return envelope.message

    def _flush_releases(self) -> None:
        resources = self._resources
        notify = resources.connection.notify
        released = resources.mappings.take_released()
        if released:
            notify(ReleaseRegions(tuple(released)))
        closed, resources.never_mapped = resources.never_mapped, []
        if resources.cuda is not None:
            # Each group comes with a fence on the stream its tensors were used on.
            for region_ids, fence in resources.cuda.take_released():
                notify(ReleaseRegions(region_ids, event=fence))
            closed += resources.cuda.take_closed()
        if closed:
            notify(ReleaseRegions(closed_slabs=tuple(closed)))


def _daemon_gpu(device_uuid: str) -> int | None:
    """The index of the daemon's GPU in this process, when the daemon runs on one and torch
    here has CUDA; None otherwise (a GPU output then raises when it arrives). Raises
    DeviceMismatch when this process cannot see that GPU."""
    if not device_uuid or not torch.cuda.is_available():
        return None
    return local_device(device_uuid)


def _keep_result(results: dict[int, BatchReady | BatchFailed], envelope: Envelope) -> None:
    """Keeps a batch result that arrived while the session waited for another."""
    message = envelope.message
    if isinstance(message, BatchReady | BatchFailed):
        results[message.batch_id] = message
    elif isinstance(message, Error):
        log.warning("dalid daemon: %s", message.message)


@dataclass(frozen=True)
class JobRequest:
    """What a job asks of the daemon at connect; 0 asks for the daemon's default."""

    weight: float = 1.0
    memory_bytes: int = 0
    max_inflight_batches: int = 0


def autostart_connect(
    path: Path,
    device: Device,
    *,
    autostart: bool,
    connect_timeout: float,
    name: str,
    on_push: Any,
    job: JobRequest = JobRequest(),
    hello_timeout: float = 5.0,
    earlier_jobs: tuple[EarlierJob, ...] = (),
) -> Connection:
    """A trainer connection to the daemon on ``path``, starting one first if allowed."""

    def trainer_connection() -> Connection:
        return Connection(
            path,
            Role.TRAINER,
            device=device,
            name=name,
            on_push=on_push,
            hello_timeout=hello_timeout,
            weight=job.weight,
            memory_bytes=job.memory_bytes,
            max_inflight_batches=job.max_inflight_batches,
            earlier_jobs=earlier_jobs,
        )

    if path.exists():
        try:
            return trainer_connection()
        except DaemonUnavailable:
            if not autostart:
                raise
            # A socket file no daemon answers on: a killed daemon's. A new one replaces it.
    elif not autostart:
        raise DaemonUnavailable(no_daemon_message(path, device))
    start_daemon(device, path, timeout=connect_timeout)
    return trainer_connection()
