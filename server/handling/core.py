"""The daemon's request handling, with no sockets: a table from message type to handler.

:class:`DaemonCore` takes decoded messages with the identity of the peer that sent them and
returns the reply; results that executors produce later leave through ``push``. The process
wrapper (:mod:`dalid.server.intake.daemon`) owns the socket and the threads around it. The core
handles a connection's and a job's life (hello, the IPC probe, goodbye, status, shutdown,
reload); a job's pipelines and batches are handled by ``batch_requests.py``. What the
handlers act on lives in modules of its own: jobs and peers (``jobs.py``), a job's batches in
flight (``admission.py``), its output memory (``job_outputs.py``), the fair share between jobs
(``scheduler.py``), the pipelines' executors (``executor.py``) and the pipeline repository
(``reload.py``).

Opening a job within the quotas, and the output memory jobs reserve, are ``opening.py``'s; how
jobs and connections end is ``endings.py``'s.
"""

from __future__ import annotations

import enum
import logging
import os
import secrets
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from dalid.protocol import (
    PROTOCOL_VERSION,
    CheckpointPipeline,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    IpcProbeResult,
    LoaderWorkers,
    Message,
    Ok,
    Ping,
    Pong,
    ProtocolError,
    RegisterNamedPipeline,
    RegisterPipeline,
    ReleaseRegions,
    ReloadRepository,
    RestorePipeline,
    Role,
    ScheduleBatch,
    Shutdown,
    StatusReport,
    StatusRequest,
    SubmitBatch,
    TrainerProgress,
    WantBatch,
    Welcome,
    device_label,
    installation,
    pid_namespace,
    release,
)

from ..errors import RequestRefused
from ..jobs.inputs import InputMemory
from ..jobs.jobs import Job, JobRegistry, Peer
from ..jobs.quotas import Quotas
from ..jobs.reservations import OutputMemory
from ..outputs.job_outputs import OutputsFactory
from ..outputs.store import StreamFactory, no_streams
from ..pipelines.flight import FlightRecorder
from ..pipelines.operators import ALLOW_LIST, OperatorPolicy
from ..pipelines.reload import LiveRepository
from ..pipelines.repository import PipelineRepository
from ..pipelines.spec import CpuExecutor
from ..runs.cohort_registry import Cohorts
from ..runs.scheduler import FairScheduler
from .batch_requests import BatchRequests
from .checkpoints import Checkpoints
from .endings import Closing, JobEndings
from .opening import JobOpening
from .push import Push
from .reclaiming import IdleReclaim
from .registration import SHARING, PipelineBuilder, Sharing
from .status import status_report

if TYPE_CHECKING:
    from ..outputs.cuda_staged import OutputPaths

log = logging.getLogger("dalid.server")


class PeerProcess(Protocol):
    """What the core reads of a connection's credentials (``intake/credentials.py`` reads them
    from the socket, a stage above): the pid of the process behind it, 0 where it cannot be seen
    from the daemon's pid namespace, and its uid."""

    @property
    def pid(self) -> int: ...

    @property
    def uid(self) -> int: ...


class StopAsked(enum.Enum):
    """Whether a client asked the daemon to stop (a ``shutdown`` request), and how."""

    NO = enum.auto()
    KEEP_JOBS = enum.auto()  # `dalid stop`: a job that reconnects waits for the next daemon
    END_JOBS = enum.auto()  # `dalid stop --end-jobs`: its jobs end with it


# Requests a connection may send before its hello.
_NEEDS_NO_HELLO = (Hello, Ping, Shutdown, StatusRequest, ReloadRepository)


class DaemonCore:
    """Handles requests for one device. ``push(peer, message)`` must be thread-safe.

    ``outputs`` makes each job's output stores (shared memory; on a GPU daemon, device memory
    too). ``quotas`` bound what jobs get; ``concurrency`` batches run at once, shared between
    busy jobs by weight (:mod:`dalid.server.runs.scheduler`). ``device_uuid`` names a GPU
    daemon's GPU in the welcome. ``repository`` holds the pipelines clients may select by name.
    ``sharing`` says how jobs share pipelines, whose outputs come on ``streams`` of their own.
    ``credentials(peer)`` gives the process behind a connection, as its socket tells (the
    daemon's loop reads them, :mod:`dalid.server.intake.credentials`): a job lives as long as
    that process does, whatever pid the client claims; without them (no socket, or a process
    in a pid namespace the daemon cannot see) a job lives as long as its connection.
    ``paths`` (a GPU daemon's) chooses how each job's GPU outputs reach its trainer.
    """

    def __init__(
        self,
        device: str | int,
        outputs: OutputsFactory,
        push: Push,
        quotas: Quotas,
        instance: str | None = None,
        *,
        concurrency: int = 4,
        device_uuid: str = "",
        repository: PipelineRepository | None = None,
        sharing: Sharing = SHARING,
        cpu_executor: CpuExecutor = CpuExecutor.LEGACY,
        streams: StreamFactory = no_streams,
        credentials: Callable[[bytes], PeerProcess | None] = lambda _: None,
        paths: OutputPaths | None = None,
        operators: OperatorPolicy = ALLOW_LIST,
        recorder: FlightRecorder | None = None,
    ) -> None:
        from nvidia.dali import __version__ as dali_version

        self.repository = LiveRepository(repository)
        self.device = device
        self.device_id = None if device == "cpu" else int(device)
        self.device_uuid = device_uuid
        self.paths = paths
        self._push = push
        self._credentials = credentials
        self.quotas = quotas
        self.inputs = InputMemory(quotas.input_memory)
        self.scheduler = FairScheduler(concurrency)
        self.dali_version = dali_version
        # Told to trainers, which say so when they are of another installation.
        self.release = release()
        self.installation = installation()
        self._instance = instance or f"{os.getpid()}-{secrets.token_hex(3)}"
        self._pid_namespace = pid_namespace()
        self._started = time.monotonic()
        self.registry = JobRegistry(self._pid_namespace)
        # Idle jobs ended to make room for a new job or another job's pipeline (reclaim.py).
        self.reclaiming = IdleReclaim(self.registry, quotas.reclaim_idle_s, self._end_idle_job)
        # Jobs opened within the quotas, and what they reserve of output memory.
        self.opening = JobOpening(
            self.registry,
            quotas,
            self.inputs,
            self.scheduler,
            outputs=outputs,
            prefix=f"dalid-{self._instance}",
            reclaiming=self.reclaiming,
        )
        self.pipelines = PipelineBuilder(
            self.device_id,
            quotas.max_batch_size,
            self.repository,
            self.scheduler,
            push,
            sharing=sharing,
            cpu_executor=cpu_executor,
            streams=streams,
            operators=operators,
            max_threads=quotas.max_threads,
            max_pipelines=quotas.max_daemon_pipelines,
            user_share=quotas.user_share,
            recorder=recorder,
        )
        # Jobs that share the runs of batches of the same inputs (cohorts.py).
        self.cohorts = Cohorts(
            self.opening.cohort_outputs,
            quotas.cohort_bytes,
            self.registry.alive,
            charge=self.scheduler.charge,
            share=self.scheduler.share_run,
            behind=self.scheduler.set_behind,
        )
        # How jobs and connections end.
        self.endings = JobEndings(self.registry, self.scheduler, self.cohorts, push)
        # A job's pipelines and batches: registrations, submissions, releases, results.
        self.batches = BatchRequests(
            self.registry,
            quotas,
            self.pipelines,
            self.inputs,
            push,
            cohorts=self.cohorts,
            prefix=f"dalid-{self._instance}",
            reclaiming=self.reclaiming,
        )
        self.checkpoints = Checkpoints(self.registry.peers)
        # Set by a shutdown request; the daemon's loop stops once it is (farewell.py).
        self.stop_asked = StopAsked.NO
        self._handlers: dict[type[Message], Callable[[bytes, Any, int | None], Message | None]] = {
            Hello: self._on_hello,
            IpcProbeResult: self._on_ipc_probe_result,
            Goodbye: self._on_goodbye,
            Ping: self._on_ping,
            Shutdown: self._on_shutdown,
            StatusRequest: self._on_status,
            RegisterPipeline: self.batches.on_register_pipeline,
            RegisterNamedPipeline: self.batches.on_register_pipeline,
            SubmitBatch: self.batches.on_submit_batch,
            ScheduleBatch: self.batches.on_schedule_batch,
            WantBatch: self.batches.on_want_batch,
            ReleaseRegions: self.batches.on_release_regions,
            TrainerProgress: self._on_trainer_progress,
            LoaderWorkers: self._on_loader_workers,
            ReloadRepository: self._on_reload_repository,
            CheckpointPipeline: self.checkpoints.on_checkpoint_pipeline,
            RestorePipeline: self.checkpoints.on_restore_pipeline,
        }

    @property
    def jobs(self) -> dict[int, Job]:
        return self.registry.jobs

    @property
    def peers(self) -> dict[bytes, Peer]:
        return self.registry.peers

    @property
    def output_memory(self) -> dict[str, OutputMemory]:
        """What jobs reserve of output memory, by the device of their stores."""
        return self.opening.output_memory

    # --- entry points ---------------------------------------------------------------------------

    def handle(self, identity: bytes, message: Message, request_id: int | None) -> Message | None:
        """The reply to one message (None for a notification that went well)."""
        handler = self._handlers.get(type(message))
        try:
            if handler is None:
                raise RequestRefused(
                    ErrorCode.UNKNOWN_OPERATION, f"{message.OP!r} is not a request to the daemon"
                )
            if request_id is None and identity not in self.peers:
                # A notification (a release, progress figures) from a connection whose job
                # ended, or that a replaced daemon welcomed: nothing to apply, and an error
                # pushed back would only be logged by a peer that is going away.
                log.debug("%s from a connection that is not in a job: ignored", message.OP)
                return None
            if not isinstance(message, _NEEDS_NO_HELLO) and identity not in self.peers:
                raise RequestRefused(
                    ErrorCode.NOT_WELCOMED, f"{message.OP}: send hello first on this connection"
                )
            return handler(identity, message, request_id)
        except RequestRefused as refusal:
            return Error(refusal.code, str(refusal), op=message.OP, ends_jobs=refusal.ends_jobs)
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
        return self.endings.reap()

    def close_job(self, job: Job, why: Closing = Closing.JOB_ENDED) -> None:
        self.endings.close_job(job, why)

    def _end_idle_job(self, job: Job, why: str) -> None:
        """Ends a job reclaimed for a newcomer as any job ends, its trainer told ``why``."""
        self.endings.end_idle(job, why)

    def trainer_unreachable(self, identity: bytes) -> None:
        self.endings.trainer_unreachable(identity)

    def peer_disconnected(self, identity: bytes) -> None:
        """The connection of ``identity`` closed or stopped answering heartbeats: a trainer's
        ends its job, a worker's takes its batches with it (``endings.py``)."""
        self.endings.peer_disconnected(identity)

    def close(self) -> None:
        self.endings.close_all()
        self.registry.close()
        self.cohorts.close()
        if self.paths is not None:
            self.paths.close()

    def job_for(self, identity: bytes) -> Job | None:
        return self.registry.job_for(identity)

    def reload_repository(self, answer: Callable[[Message], None] | None = None) -> None:
        """Loads the pipeline repository again in the background (see ``reload.py``)."""
        self.repository.reload(answer)

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
            uid = credentials.uid if credentials is not None else -1
            job = self.opening.open(identity, hello, pid, uid)
        else:
            found = self.registry.named(hello.job_id or 0, hello.job_token or "")
            ended_why = self.endings.ended_why(hello.job_id or 0, hello.job_token or "")
            if found is None and ended_why:
                # Told as its trainer and workers were: the job ended, not a wrong token.
                raise RequestRefused(ErrorCode.UNKNOWN_JOB, ended_why, ends_jobs=True)
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
        peer = self.registry.join(identity, hello, job, pid, earlier_token)
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
            ipc_probe=self.paths.probe if self.paths is not None else "",
            batch_id_base=peer.batch_ids.base,
            release=self.release,
            installation=self.installation,
            want_in_release=True,
            progress_in_release=True,
            loader_workers=True,
        )

    def _on_ipc_probe_result(
        self, identity: bytes, result: IpcProbeResult, _request_id: int | None
    ) -> Message:
        peer = self.peers[identity]
        if peer.role is not Role.TRAINER:
            raise RequestRefused(ErrorCode.NOT_WELCOMED, "only a trainer answers the IPC probe")
        if self.paths is None:
            raise RequestRefused(
                ErrorCode.MALFORMED_MESSAGE, "this daemon has no GPU outputs and sent no probe"
            )
        # Staged outputs are host memory: they count against the daemon's --memory-limit.
        return self.paths.choose(peer.job, result, self.output_memory["cpu"])

    def _on_goodbye(self, identity: bytes, goodbye: Goodbye, _request_id: int | None) -> Message:
        peer = self.peers[identity]
        if peer.role is Role.TRAINER:
            log.info("job %d said goodbye", peer.job.job_id)
            # The trainer has unmapped every slab but these (Note [GPU output lifetime]).
            peer.job.outputs.peer_leaving(goodbye.kept_slabs)
            self.cohorts.peer_leaving(peer.job.job_id, goodbye.kept_slabs)
            self.endings.close_job(peer.job)
        else:
            self.endings.worker_left(identity)
            self.registry.forget_peer(identity)
        return Ok()

    def _on_ping(self, identity: bytes, _: Ping, _request_id: int | None) -> Message:
        return Pong(os.getpid())

    def _on_status(self, identity: bytes, _: StatusRequest, _request_id: int | None) -> Message:
        return self.status()

    def status(self) -> StatusReport:
        """The daemon and its jobs now (also what the metrics endpoint serves)."""
        return status_report(self, time.monotonic() - self._started)

    def _on_trainer_progress(
        self, identity: bytes, progress: TrainerProgress, _request_id: int | None
    ) -> None:
        self.peers[identity].job.trainer_waited = progress.waited_seconds

    def _on_loader_workers(
        self, identity: bytes, told: LoaderWorkers, _request_id: int | None
    ) -> Message:
        peer = self.peers[identity]
        if peer.role is not Role.TRAINER:
            raise RequestRefused(
                ErrorCode.NOT_WELCOMED, "only a trainer tells how many workers its loaders run"
            )
        peer.job.workers_started = told.workers
        return Ok()

    def _on_reload_repository(
        self, identity: bytes, _: ReloadRepository, request_id: int | None
    ) -> None:
        self.reload_repository(lambda reply: self._push(identity, reply, request_id))
        # answered once loaded

    def _on_shutdown(self, identity: bytes, request: Shutdown, _request_id: int | None) -> Message:
        log.info("shutdown requested%s", ", ending every job" if request.end_jobs else "")
        self.stop_asked = StopAsked.END_JOBS if request.end_jobs else StopAsked.KEEP_JOBS
        return Ok()
