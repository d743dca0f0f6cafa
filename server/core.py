"""The daemon's state and request handling, with no sockets: jobs, peers, pipelines, batches.

:class:`DaemonCore` takes decoded messages with the identity of the peer that sent them and
returns the reply; results that executors produce later leave through ``push``. The process
wrapper (:mod:`dalid.server.daemon`) owns the socket and the threads around it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hmac
import itertools
import json
import logging
import math
import os
import secrets
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dalid.protocol import (
    PROTOCOL_VERSION,
    BatchAccepted,
    BatchFailed,
    BatchReady,
    EarlierJob,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    Limits,
    Message,
    Ok,
    Ping,
    PipelineRegistered,
    Pong,
    ProtocolError,
    RegisterNamedPipeline,
    RegisterPipeline,
    ReleaseRegions,
    ReloadRepository,
    RepositoryFailure,
    RepositoryReport,
    Role,
    ScheduleBatch,
    Shutdown,
    StatusReport,
    StatusRequest,
    SubmitBatch,
    TrainerProgress,
    Welcome,
    device_label,
    pid_namespace,
    process_running,
)

from .credentials import PeerCredentials
from .cuda import CudaBackend
from .executor import PendingBatch, PipelineExecutor
from .inputs import InputMemory, InputRefused
from .memory import SlabBackend
from .pool import RegionPool
from .quotas import QuotaRefused, Quotas, grant
from .repository import PipelineRepository, RepositoryUnavailable
from .reservations import OutputMemory
from .runner import PipelineBuildError, PipelineRunner, PipelineSpec
from .scheduler import FairScheduler, JobSlots
from .status import RateMeter, job_status

log = logging.getLogger("dalid.server")
# A failure's message in a repository report is cut to this many characters (the daemon's log
# has the whole traceback).
MAX_FAILURE_MESSAGE = 1000

Push = Callable[[bytes, Message, int | None], None]
"""push(peer, message, request_id): queues a message for a peer; safe from any thread."""


@dataclass
class WaitingBatch:
    """A batch received over its job's in-flight limit: its sender waits for the acceptance."""

    sender: bytes
    request_id: int | None
    batch: PendingBatch
    executor: PipelineExecutor


@dataclass
class Job:
    """One training job: its trainer connection, pipelines, deferred batches and output pools.

    On a GPU daemon ``gpu_pool`` holds its GPU outputs, in memory of ``cuda``. ``inflight``
    counts the batches handed to its pipelines and not yet answered; batches over its limit
    wait in ``waiting``. Both change in executor threads too, under ``lock``.
    """

    job_id: int
    token: str
    trainer: bytes
    pid: int
    pid_namespace: int
    name: str
    limits: Limits
    pool: RegionPool
    gpu_pool: RegionPool | None = None
    cuda: CudaBackend | None = None
    pipelines: dict[int, PipelineExecutor] = field(default_factory=dict)
    deferred: dict[int, PendingBatch] = field(default_factory=dict)
    peers: set[bytes] = field(default_factory=set)
    next_batch_id: int = 1
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    inflight: int = 0
    waiting: collections.deque[WaitingBatch] = field(default_factory=collections.deque)
    batches_failed: int = 0
    meter: RateMeter = field(default_factory=RateMeter)
    trainer_waited: float = 0.0
    connected_at: float = field(default_factory=time.monotonic)
    # The jobs its trainer had on earlier daemons of the socket (Hello.earlier_jobs): a worker
    # naming one of them joins this job. They go with the job, since lookups go through jobs.
    earlier_jobs: tuple[EarlierJob, ...] = ()
    # (earlier job's token, a pipeline's id in that job) -> the pipeline's id in this job.
    earlier_pipelines: dict[tuple[str, int], int] = field(default_factory=dict)

    def close(self) -> list[WaitingBatch]:
        """Stops the job's pipelines and frees its pools; the batches that still waited.

        Idempotent. GPU slabs the trainer still maps are not freed yet: the caller closes
        ``cuda`` once the trainer has unmapped them or is gone (Note [GPU output lifetime]).
        """
        if self.closed:
            return []
        self.closed = True
        with self.lock:
            waiting = list(self.waiting)
            self.waiting.clear()
        stopped = [executor.stop() for executor in self.pipelines.values()]
        self.pipelines.clear()
        self.deferred.clear()
        # An executor stuck inside DALI may still write its outputs: keep the memory mapped.
        self.pool.close(unmap=all(stopped))
        if self.gpu_pool is not None:
            self.gpu_pool.close(unmap=all(stopped))
        return waiting


@dataclass
class Peer:
    identity: bytes
    role: Role
    job: Job
    pid: int
    pid_namespace: int
    # A worker that joined as an earlier job of its trainer: that job's token. Its batches name
    # pipelines by their ids in that job.
    earlier_token: str = ""


class RequestRefused(Exception):
    """A request the daemon answers with an error reply."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class DaemonCore:
    """Handles requests for one device. ``push(peer, message)`` must be thread-safe.

    ``quotas`` bound what jobs get; ``concurrency`` batches run at once, shared between busy
    jobs by weight (:mod:`dalid.server.scheduler`). On a GPU daemon, ``cuda_backend()`` makes
    each job's GPU memory and ``device_uuid`` names the GPU in the welcome. ``repository``
    holds the pipelines clients may select by name. ``credentials(peer)`` gives the process
    behind a connection, as its socket tells (:mod:`dalid.server.credentials`): a job lives as
    long as that process does, whatever pid the client claims; without them (no socket, or a
    process in a pid namespace the daemon cannot see) a job lives as long as its connection.
    """

    def __init__(
        self,
        device: str | int,
        backend: SlabBackend,
        push: Push,
        quotas: Quotas,
        instance: str | None = None,
        *,
        concurrency: int = 4,
        device_uuid: str = "",
        cuda_backend: Callable[[], CudaBackend] | None = None,
        repository: PipelineRepository | None = None,
        credentials: Callable[[bytes], PeerCredentials | None] = lambda _: None,
    ) -> None:
        from nvidia.dali import __version__ as dali_version

        # Replaced whole by a reload, never changed in place: a registration reads it once,
        # at its arrival, and builds from the definition it found.
        self.repository = repository or PipelineRepository()
        # One reload at a time, each reading the directory as it is when it starts.
        self._reload_lock = threading.Lock()
        self.device = device
        self.device_id = None if device == "cpu" else int(device)
        self.device_uuid = device_uuid
        self._backend = backend
        self._cuda_backend = cuda_backend
        # Ended jobs whose trainer still maps GPU slabs: freed once it exits (see reap).
        self._orphans: list[Job] = []
        self._push = push
        self._credentials = credentials
        self.quotas = quotas
        # Shared memory against --memory-limit; GPU memory reserved the same way, unlimited.
        self.output_memory = OutputMemory(quotas.memory_limit)
        self._device_memory = OutputMemory(0)
        self.inputs = InputMemory(quotas.input_memory)
        self.scheduler = FairScheduler(concurrency)
        self.dali_version = dali_version
        self._instance = instance or f"{os.getpid()}-{secrets.token_hex(3)}"
        self._pid_namespace = pid_namespace()
        self._started = time.monotonic()
        self.jobs: dict[int, Job] = {}
        self.peers: dict[bytes, Peer] = {}
        self._next_job_id = 1
        self._next_pipeline_id = 1
        self.stop_requested = False
        self._handlers: dict[type[Message], Callable[[bytes, Any, int | None], Message | None]] = {
            Hello: self._on_hello,
            Goodbye: self._on_goodbye,
            Ping: self._on_ping,
            Shutdown: self._on_shutdown,
            StatusRequest: self._on_status,
            RegisterPipeline: self._on_register_pipeline,
            RegisterNamedPipeline: self._on_register_named_pipeline,
            SubmitBatch: self._on_submit_batch,
            ScheduleBatch: self._on_schedule_batch,
            ReleaseRegions: self._on_release_regions,
            TrainerProgress: self._on_trainer_progress,
            ReloadRepository: self._on_reload_repository,
        }

    # --- entry points ---------------------------------------------------------------------------

    def handle(self, identity: bytes, message: Message, request_id: int | None) -> Message | None:
        """The reply to one message (None for a notification that went well)."""
        handler = self._handlers.get(type(message))
        try:
            if handler is None:
                raise RequestRefused(
                    ErrorCode.UNKNOWN_OPERATION, f"{message.OP!r} is not a request to the daemon"
                )
            if isinstance(message, TrainerProgress) and identity not in self.peers:
                # Figures for `dalid status` only, from a connection of a daemon that was
                # replaced (it has not noticed yet): nothing to apply, nobody to tell.
                return None
            if not isinstance(
                message, Hello | Ping | Shutdown | StatusRequest | ReloadRepository
            ) and (identity not in self.peers):
                raise RequestRefused(
                    ErrorCode.NOT_WELCOMED, f"{message.OP}: send hello first on this connection"
                )
            return handler(identity, message, request_id)
        except RequestRefused as refusal:
            return Error(refusal.code, str(refusal), op=message.OP)
        except Exception as error:
            log.exception("internal error handling %s", message.OP)
            return Error(
                ErrorCode.INTERNAL_ERROR,
                f"{message.OP}: {type(error).__name__}: {error}",
                traceback=traceback.format_exc(),
                op=message.OP,
            )

    @staticmethod
    def malformed(error: ProtocolError) -> Error:
        return Error(error.code, error.message, op=error.op)

    def reap(self) -> list[int]:
        """Closes the jobs whose trainer process is gone; returns their ids."""
        for identity, peer in list(self.peers.items()):
            if peer.role is Role.WORKER and not self._alive(peer.pid, peer.pid_namespace):
                self._forget_peer(identity)
        dead = [job for job in self.jobs.values() if not self._alive(job.pid, job.pid_namespace)]
        for job in dead:
            log.info("job %d: trainer pid %d is gone, freeing what it held", job.job_id, job.pid)
            self.close_job(job)
        for job in list(self._orphans):
            if not self._alive(job.pid, job.pid_namespace):
                log.info("job %d: trainer %d is gone, freeing its GPU slabs", job.job_id, job.pid)
                self._orphans.remove(job)
                self._free_gpu(job)
        return [job.job_id for job in dead]

    def close_job(self, job: Job, daemon_stopping: bool = False) -> None:
        for identity in list(job.peers):
            self.peers.pop(identity, None)
        self.jobs.pop(job.job_id, None)
        share = self.scheduler.stats(job.job_id)
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
        self.scheduler.remove_job(job.job_id)
        for waiting in job.close():
            # Its sender still waits for the acceptance; tell it why none comes.
            self._push(
                waiting.sender,
                Error(
                    ErrorCode.UNKNOWN_JOB,
                    f"job {job.job_id} ended before its batch was accepted",
                    op=SubmitBatch.OP,
                ),
                waiting.request_id,
            )
        cuda = job.cuda
        if cuda is None or cuda.closed:
            return
        cuda.forget_peer_events()
        if cuda.awaiting_peer and not daemon_stopping and self._alive(job.pid, job.pid_namespace):
            # Tensors of the trainer still view these slabs; CUDA forbids freeing them before it
            # unmaps them, which its process exit does (Note [GPU output lifetime]).
            log.info(
                "job %d: keeping %d GPU slabs its trainer still maps until pid %d exits",
                job.job_id,
                cuda.awaiting_peer,
                job.pid,
            )
            self._orphans.append(job)
        else:
            self._free_gpu(job)

    @staticmethod
    def _free_gpu(job: Job) -> None:
        assert job.cuda is not None
        try:
            job.cuda.close()
        except Exception:
            log.exception("job %d: freeing GPU memory failed", job.job_id)

    def trainer_unreachable(self, identity: bytes) -> None:
        peer = self.peers.get(identity)
        if peer is not None and peer.role is Role.TRAINER:
            log.info("job %d: trainer disconnected", peer.job.job_id)
            self.close_job(peer.job)

    def peer_disconnected(self, identity: bytes) -> None:
        """The connection of ``identity`` closed or stopped answering heartbeats.

        A trainer's ends its job; a worker's takes with it the batches it sent over the job's
        limit, which nobody else could ask for.
        """
        peer = self.peers.get(identity)
        if peer is None:
            return
        if peer.role is Role.TRAINER:
            log.info(
                "job %d: the trainer's connection closed, freeing what it held", peer.job.job_id
            )
            self.close_job(peer.job)
            return
        job = peer.job
        with job.lock:
            kept = [waiting for waiting in job.waiting if waiting.sender != identity]
            dropped = len(job.waiting) - len(kept)
            job.waiting = collections.deque(kept)
        if dropped:
            log.info("job %d: a worker left; dropped %d batches it sent", job.job_id, dropped)
        self._forget_peer(identity)

    def close(self) -> None:
        for job in list(self.jobs.values()):
            self.close_job(job, daemon_stopping=True)
        orphans, self._orphans = self._orphans, []
        for job in orphans:
            self._free_gpu(job)

    def job_for(self, identity: bytes) -> Job | None:
        peer = self.peers.get(identity)
        return peer.job if peer else None

    # --- handlers -------------------------------------------------------------------------------

    def _on_hello(self, identity: bytes, hello: Hello, _request_id: int | None) -> Message:
        if hello.protocol_version != PROTOCOL_VERSION:
            raise RequestRefused(
                ErrorCode.PROTOCOL_MISMATCH,
                f"the client speaks dalid protocol version {hello.protocol_version}, this daemon "
                f"speaks version {PROTOCOL_VERSION}: install matching dalid releases",
            )
        if identity in self.peers:
            raise RequestRefused(ErrorCode.MALFORMED_MESSAGE, "hello sent twice on one connection")
        earlier_token = ""
        # The process behind the connection, as its socket tells; hello.client_pid is the
        # client's word only, and decides nothing.
        credentials = self._credentials(identity)
        pid = credentials.pid if credentials is not None else 0
        if hello.role is Role.TRAINER:
            self._check_unclaimed(hello.earlier_jobs)
            try:
                limits = grant(
                    hello,
                    self.quotas,
                    jobs=len(self.jobs),
                    max_message_bytes=self.inputs.job_limit,
                    pid=pid,
                    jobs_of_process=sum(1 for job in self.jobs.values() if job.pid == pid),
                )
                job = self._new_job(identity, hello, limits, pid)
            except QuotaRefused as refusal:
                raise RequestRefused(ErrorCode.RESOURCE_EXHAUSTED, str(refusal)) from None
            self.jobs[job.job_id] = job
            self.scheduler.add_job(job.job_id, limits.weight)
            log.info(
                "job %d (%s, pid %d) connected: weight %g, %s MiB of output memory, %d batches "
                "in flight%s",
                job.job_id,
                hello.name or "?",
                pid,
                limits.weight,
                f"{limits.pool_bytes >> 20}"
                if hello.memory_bytes
                else f"up to {limits.pool_bytes >> 20}",
                limits.max_inflight_batches,
                f"; it was job {', '.join(str(e.job_id) for e in hello.earlier_jobs)} of earlier "
                "daemons"
                if hello.earlier_jobs
                else "",
            )
        else:
            found = self._job_named(hello.job_id or 0, hello.job_token or "")
            if found is None:
                raise RequestRefused(
                    ErrorCode.UNKNOWN_JOB,
                    f"no job {hello.job_id} with that token on this daemon: the trainer's session "
                    "was closed, or this worker belongs to another daemon (whose trainer has not "
                    "reconnected here)",
                )
            job, earlier_token = found
            if earlier_token:
                log.info(
                    "job %d: worker pid %d joined as job %d of an earlier daemon",
                    job.job_id,
                    pid,
                    hello.job_id,
                )
        job.peers.add(identity)
        self.peers[identity] = Peer(
            identity, hello.role, job, pid, self._pid_namespace, earlier_token
        )
        return Welcome(
            protocol_version=PROTOCOL_VERSION,
            daemon_pid=os.getpid(),
            device=device_label(self.device),
            dali_version=self.dali_version,
            job_id=job.job_id,
            job_token=job.token,
            limits=job.limits,
            device_uuid=self.device_uuid,
            pid_namespace=self._pid_namespace,
        )

    def _job_named(self, job_id: int, token: str) -> tuple[Job, str] | None:
        """The job that (``job_id``, ``token``) names, and "" for a live job of this daemon or
        the token of the earlier job it names; None if none."""
        live = self.jobs.get(job_id)
        if live is not None and _same_token(live.token, token):
            return live, ""
        for job in self.jobs.values():
            for earlier in job.earlier_jobs:
                if earlier.job_id == job_id and _same_token(earlier.job_token, token):
                    return job, earlier.job_token
        return None

    def _check_unclaimed(self, earlier_jobs: tuple[EarlierJob, ...]) -> None:
        """Refuses a trainer's claim on an earlier job that already names a job here: two jobs
        answering to one identity would let one's workers into the other."""
        for earlier in earlier_jobs:
            found = self._job_named(earlier.job_id, earlier.job_token)
            if found is not None:
                owner, earlier_token = found
                raise RequestRefused(
                    ErrorCode.JOB_CLAIMED,
                    f"earlier job {earlier.job_id} with that token is "
                    + (f"claimed by job {owner.job_id}" if earlier_token else "a live job")
                    + " on this daemon: a job's identity belongs to one trainer",
                )

    @property
    def memory_reserved(self) -> int:
        """The shared memory the open jobs have reserved for their outputs."""
        return self.output_memory.reserved

    def _new_job(self, identity: bytes, hello: Hello, limits: Limits, pid: int) -> Job:
        """A job with pools that hold ``limits.pool_bytes``, reserved now if the job asked
        for that much (raises QuotaRefused when the daemon has not that much left), else as
        its outputs need (:mod:`dalid.server.reservations`)."""
        job_id = self._next_job_id
        memory = self.output_memory, self._device_memory
        if hello.memory_bytes:
            growth, device_growth = (m.fixed(job_id, limits.pool_bytes) for m in memory)
        else:
            growth, device_growth = (m.growing(job_id, limits.pool_bytes) for m in memory)
        self._next_job_id += 1
        prefix = f"dalid-{self._instance}-j{job_id}"
        # One id sequence for both pools: a region id names one region of the job.
        region_ids = itertools.count(1)
        # The pools own the reservations from here (a pool closes its growth).
        job = Job(
            job_id=job_id,
            token=secrets.token_hex(16),
            trainer=identity,
            pid=pid,
            pid_namespace=self._pid_namespace,
            name=hello.name,
            limits=limits,
            earlier_jobs=hello.earlier_jobs,
            pool=RegionPool(
                self._backend,
                prefix,
                growth.bytes,
                limits.slab_bytes,
                region_ids=region_ids,
                growth=growth,
            ),
        )
        if self._cuda_backend is None:
            device_growth.close()
            return job
        try:
            job.cuda = self._cuda_backend()
        except BaseException:
            job.pool.close()
            device_growth.close()
            raise
        job.gpu_pool = RegionPool(
            job.cuda,
            f"{prefix}-cuda",
            device_growth.bytes,
            limits.slab_bytes,
            region_ids=region_ids,
            growth=device_growth,
        )
        return job

    def _on_goodbye(self, identity: bytes, goodbye: Goodbye, _request_id: int | None) -> Message:
        peer = self.peers[identity]
        if peer.role is Role.TRAINER:
            log.info("job %d said goodbye", peer.job.job_id)
            if peer.job.cuda is not None:
                # Every GPU slab but these is unmapped in the trainer (Note [GPU output lifetime]).
                peer.job.cuda.peer_kept(goodbye.kept_slabs)
            self.close_job(peer.job)
        else:
            self._forget_peer(identity)
        return Ok()

    def _on_ping(self, identity: bytes, _: Ping, _request_id: int | None) -> Message:
        return Pong(os.getpid())

    def _on_status(self, identity: bytes, _: StatusRequest, _request_id: int | None) -> Message:
        return self.status()

    def status(self) -> StatusReport:
        """The daemon and its jobs now (also what the metrics endpoint serves)."""
        now = time.monotonic()
        return StatusReport(
            daemon_pid=os.getpid(),
            device=device_label(self.device),
            device_uuid=self.device_uuid,
            dali_version=self.dali_version,
            protocol_version=PROTOCOL_VERSION,
            uptime_seconds=now - self._started,
            max_jobs=self.quotas.max_jobs,
            concurrency=self.scheduler.slots,
            memory_limit=self.quotas.memory_limit,
            memory_reserved=self.memory_reserved,
            jobs=tuple(
                job_status(job, self.scheduler.stats(job.job_id), now) for job in self.jobs.values()
            ),
        )

    def _on_trainer_progress(
        self, identity: bytes, progress: TrainerProgress, _request_id: int | None
    ) -> None:
        self.peers[identity].job.trainer_waited = progress.waited_seconds

    def _on_reload_repository(
        self, identity: bytes, _: ReloadRepository, request_id: int | None
    ) -> None:
        self.reload_repository(lambda reply: self._push(identity, reply, request_id))
        # answered once loaded

    def reload_repository(self, answer: Callable[[Message], None] | None = None) -> None:
        """Loads the pipeline repository again, in a thread of its own: importing user files
        may take seconds, and batches go on meanwhile. ``answer`` gets the
        :class:`RepositoryReport`, or an ``Error`` when nothing could be loaded."""

        def reload() -> None:
            with self._reload_lock:
                reply = self._reload()
            if answer is not None:
                answer(reply)

        threading.Thread(target=reload, name="dalid-reload", daemon=True).start()

    def _reload(self) -> Message:
        previous = self.repository
        try:
            repository = previous.reload()
        except RepositoryUnavailable as error:
            log.error("pipeline repository not reloaded: %s", error)
            return Error(ErrorCode.UNKNOWN_PIPELINE, str(error), op=ReloadRepository.OP)
        except Exception as error:
            log.exception("pipeline repository not reloaded")
            return Error(
                ErrorCode.INTERNAL_ERROR,
                f"the pipeline repository was not reloaded: {type(error).__name__}: {error}",
                traceback=traceback.format_exc(),
                op=ReloadRepository.OP,
            )
        self.repository = repository
        failed = "; ".join(f"{file}: {why}" for file, why in sorted(repository.failures.items()))
        log.info(
            "pipeline repository %s reloaded: %s. Pipelines: %s%s",
            repository.directory,
            repository.changes_from(previous),
            ", ".join(sorted(repository.entries)) or "none",
            f". Failed: {failed}" if failed else "",
        )
        return repository_report(repository)

    def _on_shutdown(self, identity: bytes, _: Shutdown, _request_id: int | None) -> Message:
        log.info("shutdown requested")
        self.stop_requested = True
        return Ok()

    def _on_register_pipeline(
        self, identity: bytes, request: RegisterPipeline, request_id: int | None
    ) -> Message | None:
        job = self._registering_job(identity, request)
        if request.max_batch_size > self.quotas.max_batch_size:
            raise RequestRefused(
                ErrorCode.INVALID_PIPELINE,
                f"max_batch_size {request.max_batch_size} is over this daemon's limit of "
                f"{self.quotas.max_batch_size}",
            )
        spec = PipelineSpec.from_message(request)
        make_runner = functools.partial(PipelineRunner, spec, self.device_id)
        self._start_pipeline(job, request, make_runner, request_id)
        return None  # answered once the pipeline is built

    def _on_register_named_pipeline(
        self, identity: bytes, request: RegisterNamedPipeline, request_id: int | None
    ) -> Message | None:
        job = self._registering_job(identity, request)
        parameters = json.loads(request.parameters)
        build_arguments = {
            name: getattr(request, name)
            for name in ("batch_size", "num_threads", "prefetch_queue_depth", "seed")
            if getattr(request, name) is not None
        }
        build_arguments["device_id"] = self.device_id
        try:
            definition = self.repository.definition(request.name, build_arguments, parameters)
        except KeyError as error:
            raise RequestRefused(ErrorCode.UNKNOWN_PIPELINE, error.args[0]) from None
        make_runner = functools.partial(
            PipelineRunner.from_definition,
            request.name,
            definition,
            self.device_id,
            self.quotas.max_batch_size,
            on_error=request.on_error,
        )
        self._start_pipeline(job, request, make_runner, request_id)
        return None  # answered once the pipeline is built

    def _registering_job(
        self, identity: bytes, request: RegisterPipeline | RegisterNamedPipeline
    ) -> Job:
        peer = self.peers[identity]
        if peer.role is not Role.TRAINER:
            raise RequestRefused(ErrorCode.NOT_WELCOMED, "only a trainer registers pipelines")
        job = peer.job
        live = sum(1 for executor in job.pipelines.values() if not executor.failed)
        if live >= self.quotas.max_pipelines:
            raise RequestRefused(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"job {job.job_id} already has {live} pipelines, the limit of one job (dalid "
                f"serve --max-pipelines {self.quotas.max_pipelines}): a job registers each "
                "pipeline once",
            )
        claimed = {earlier.job_token for earlier in job.earlier_jobs}
        for earlier in request.earlier_ids:
            if earlier.job_token not in claimed:
                raise RequestRefused(
                    ErrorCode.UNKNOWN_JOB,
                    f"{request.OP}: earlier_ids names a job that the hello of job {job.job_id} "
                    "did not name in earlier_jobs",
                )
        return job

    def _start_pipeline(
        self,
        job: Job,
        request: RegisterPipeline | RegisterNamedPipeline,
        make_runner: Callable[[], PipelineRunner],
        request_id: int | None,
    ) -> None:
        """Starts the pipeline's executor, which builds it; the reply leaves once it is built."""
        pipeline_id = self._next_pipeline_id
        self._next_pipeline_id += 1
        trainer = job.trainer
        # The latest registration under an earlier id wins: the trainer may register again a
        # pipeline whose build failed.
        for earlier in request.earlier_ids:
            job.earlier_pipelines[(earlier.job_token, earlier.pipeline_id)] = pipeline_id

        def on_built(result: PipelineSpec | PipelineBuildError) -> None:
            # Runs in the executor's thread: the reply leaves through the outbox.
            if isinstance(result, PipelineSpec):
                log.info("job %d registered pipeline %d %r", job.job_id, pipeline_id, result.name)
                reply: Message = PipelineRegistered(
                    pipeline_id,
                    input_names=result.input_names,
                    num_outputs=result.num_outputs,
                    max_batch_size=result.max_batch_size,
                )
            else:
                log.info("job %d: pipeline %r not built: %s", job.job_id, request.name, result)
                reply = Error(result.code, str(result), op=request.OP)
            self._push(trainer, reply, request_id)

        job.pipelines[pipeline_id] = PipelineExecutor(
            pipeline_id,
            make_runner,
            pool=job.pool,
            answer=functools.partial(self._batch_answered, job),
            on_built=on_built,
            slots=JobSlots(self.scheduler, job.job_id),
            gpu_pool=job.gpu_pool,
            cuda=job.cuda,
            max_image_pixels=job.limits.max_image_pixels,
        )

    def _on_submit_batch(
        self, identity: bytes, request: SubmitBatch, request_id: int | None
    ) -> Message | None:
        peer = self.peers[identity]
        job = peer.job
        if peer.earlier_token:
            request = self._in_this_job(job, peer.earlier_token, request)
        executor = self._executor(job, request.pipeline_id)
        spec = executor.spec
        if spec is None:
            raise RequestRefused(
                ErrorCode.UNKNOWN_PIPELINE, f"pipeline {request.pipeline_id} is not built yet"
            )
        names = [item.name for item in request.inputs]
        if sorted(names) != sorted(spec.input_names):
            raise RequestRefused(
                ErrorCode.INVALID_BATCH,
                f"the batch has inputs {names}, the pipeline takes {list(spec.input_names)}",
            )
        if request.batch_size > spec.max_batch_size:
            raise RequestRefused(
                ErrorCode.INVALID_BATCH,
                f"batch of {request.batch_size} samples, over the pipeline's max_batch_size "
                f"{spec.max_batch_size}",
            )
        nbytes = 0
        for item in request.inputs:
            itemsize = np.dtype(item.dtype).itemsize
            for index, (shape, sample) in enumerate(zip(item.shapes, item.samples, strict=True)):
                expected = math.prod(shape) * itemsize
                if sample.nbytes != expected:
                    raise RequestRefused(
                        ErrorCode.INVALID_BATCH,
                        f"input {item.name!r} sample {index}: shape {shape} of {item.dtype} needs "
                        f"{expected} bytes, its frame has {sample.nbytes}",
                    )
                nbytes += expected
        held_back = len(job.waiting) + len(job.deferred)
        if (request.deferred or job.inflight >= job.limits.max_inflight_batches) and (
            held_back >= self.quotas.max_waiting_batches
        ):
            raise RequestRefused(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"job {job.job_id} already has {held_back} batches waiting over its limit of "
                f"{job.limits.max_inflight_batches} in flight or deferred: wait for batch "
                "acceptances (or schedule deferred batches) before sending more",
            )
        batch = PendingBatch(job.next_batch_id, request)
        try:
            # Counted until the batch is freed, whichever way it goes.
            self.inputs.take(job.job_id, nbytes, holder=batch)
        except InputRefused as refusal:
            raise RequestRefused(ErrorCode.RESOURCE_EXHAUSTED, str(refusal)) from None
        job.next_batch_id += 1
        if request.deferred:
            # A deferred batch takes no turn until the trainer schedules it, and a limit here
            # could hold back the very batch the trainer waits for.
            job.deferred[batch.batch_id] = batch
            return BatchAccepted(batch.batch_id)
        with job.lock:
            if job.inflight < job.limits.max_inflight_batches:
                job.inflight += 1
                batch.counted = True
                executor.submit(batch)
                return BatchAccepted(batch.batch_id)
            # Backpressure: the sender hears back once an earlier batch of the job is answered.
            job.waiting.append(WaitingBatch(identity, request_id, batch, executor))
        return None

    def _batch_answered(
        self, job: Job, batch: PendingBatch, result: BatchReady | BatchFailed
    ) -> None:
        """Delivers a batch's result and lets the job's next waiting batch in.

        Runs in the executor's thread.
        """
        if isinstance(result, BatchFailed):
            job.batches_failed += 1
        else:
            # Skipped bad samples are not delivered; replaced ones are, as their stand-ins.
            skipped = sum(1 for bad in result.bad_samples if bad.replaced_by < 0)
            job.meter.add(batch.request.batch_size - skipped)
        self._push(job.trainer, result, None)
        if not batch.counted:
            return
        with job.lock:
            job.inflight -= 1
            admitted = job.waiting.popleft() if job.waiting and not job.closed else None
            if admitted is not None:
                job.inflight += 1
                admitted.batch.counted = True
        if admitted is not None:
            admitted.executor.submit(admitted.batch)
            self._push(admitted.sender, BatchAccepted(admitted.batch.batch_id), admitted.request_id)

    def _on_schedule_batch(
        self, identity: bytes, request: ScheduleBatch, _request_id: int | None
    ) -> Message:
        job = self.peers[identity].job
        batch = job.deferred.pop(request.batch_id, None)
        if batch is None:
            raise RequestRefused(
                ErrorCode.UNKNOWN_BATCH, f"batch {request.batch_id} is not waiting to be scheduled"
            )
        self._executor(job, batch.request.pipeline_id).submit(batch)
        return Ok()

    def _on_release_regions(
        self, identity: bytes, request: ReleaseRegions, _request_id: int | None
    ) -> Message | None:
        job = self.peers[identity].job
        if (request.event or request.closed_slabs) and job.cuda is None:
            raise RequestRefused(
                ErrorCode.MALFORMED_MESSAGE,
                "release_regions: event and closed_slabs are for GPU outputs, and this daemon "
                "delivers CPU outputs only",
            )
        if request.event:
            assert job.cuda is not None
            # Before the regions go back to the pool: every later copy into them is queued
            # after this wait (Note [GPU output lifetime], point 4).
            try:
                job.cuda.wait_for_peer(request.event)
            except Exception as error:
                raise RequestRefused(
                    ErrorCode.MALFORMED_MESSAGE,
                    f"release_regions: the release event cannot be used: {error}",
                ) from None
        unknown = job.pool.release(request.region_ids)
        if unknown and job.gpu_pool is not None:
            unknown = job.gpu_pool.release(unknown)
        if request.closed_slabs:
            assert job.cuda is not None
            job.cuda.peer_closed(request.closed_slabs)
        if unknown:
            raise RequestRefused(
                ErrorCode.UNKNOWN_REGION,
                f"regions {unknown[:8]} are not leased to job {job.job_id}",
            )
        return None

    # --- helpers --------------------------------------------------------------------------------

    def _executor(self, job: Job, pipeline_id: int) -> PipelineExecutor:
        executor = job.pipelines.get(pipeline_id)
        if executor is None:
            raise RequestRefused(
                ErrorCode.UNKNOWN_PIPELINE, f"job {job.job_id} has no pipeline {pipeline_id}"
            )
        if executor.failed:
            raise RequestRefused(
                ErrorCode.PIPELINE_ERROR,
                f"pipeline {pipeline_id} stopped working and takes no more batches (the daemon's "
                "log says why): register it again",
            )
        return executor

    @staticmethod
    def _in_this_job(job: Job, earlier_token: str, request: SubmitBatch) -> SubmitBatch:
        """A batch of a worker that joined as an earlier job, naming its pipeline by the id it
        has in ``job``."""
        pipeline_id = job.earlier_pipelines.get((earlier_token, request.pipeline_id))
        if pipeline_id is None:
            raise RequestRefused(
                ErrorCode.UNKNOWN_PIPELINE,
                f"job {job.job_id} has not registered again pipeline {request.pipeline_id} of "
                "its earlier job (yet)",
            )
        return dataclasses.replace(request, pipeline_id=pipeline_id)

    def _forget_peer(self, identity: bytes) -> None:
        peer = self.peers.pop(identity, None)
        if peer is not None:
            peer.job.peers.discard(identity)

    def _alive(self, pid: int, namespace: int) -> bool:
        if namespace != self._pid_namespace or pid <= 0:
            return True  # another pid namespace: its pid means nothing here
        return process_running(pid)


def repository_report(repository: PipelineRepository) -> RepositoryReport:
    """What the repository serves and which of its files failed, as ``dalid reload`` shows."""
    return RepositoryReport(
        directory=str(repository.directory or ""),
        pipelines=tuple(sorted(repository.entries)),
        failures=tuple(
            RepositoryFailure(
                file,
                why if len(why) <= MAX_FAILURE_MESSAGE else why[: MAX_FAILURE_MESSAGE - 3] + "...",
                kept_pipelines=repository.kept.get(file, ()),
            )
            for file, why in sorted(repository.failures.items())
        ),
    )


def _same_token(expected: str, given: str) -> bool:
    """Compares a secret token in constant time (as bytes: ``given`` may be any string)."""
    return hmac.compare_digest(expected.encode(), given.encode())
