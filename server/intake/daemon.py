"""The daemon process: one ROUTER socket, one I/O loop, and the core behind it.

The I/O thread receives every message; an executor sends a batch's result itself, and what
cannot leave at once waits for the loop in an outbox (:mod:`.shared_socket`). The loop waits on
the socket's descriptor and an eventfd beside it, which executors and signals write to wake it.

A peer that dies is noticed by its connection, in any pid namespace: the kernel closes a killed
process's socket at once, and the socket monitor reports the closed file descriptor, which the
loop maps back to the peer that last sent on it. A trainer whose process is stopped or frozen
has its connection dropped by the loop (:mod:`.frozen`).

The loop reads at most a turn's worth of messages before it sends what is ready, and every
connection is held to its limits (:mod:`dalid.server.intake.intake`): whatever a client sends, the
daemon keeps serving the others, answers a new hello at once and stops when told to.

SIGHUP loads the pipeline repository again, as ``dalid reload`` does (the loop starts the
reload; the log tells what it loaded).

What the daemon keeps in the runtime directory (the socket's lock file, the socket file, the
GPU UUID link) is its claim on the socket's path, :mod:`dalid.server.intake.socket_claim`.

It holds the socket from bind to close (through :class:`SharedSocket`), its monitor, the
connections' intake and the loop that serves them.

Note [No heartbeats from the daemon]
------------------------------------
libzmq 4.3.5 aborts the process when a peer closes a connection whose input is stopped (any
unread message stops it) and a ZeroMQ heartbeat of that connection fires before the socket
reads again: a job that ended while the loop was busy, or during a stop, took the daemon down.
So the daemon's socket sends no heartbeats, and stopped or frozen trainers are found by their
process's state instead (:mod:`.frozen`). Why and the tests: docs/design/daemon-loop.md.

Note [Closing with peers connected]
-----------------------------------
A stopping daemon reads, and drops, what its peers send until they have gone (at most
``NOTICE_LINGER_MS``), so that its notices leave; then it closes the socket at once, before it
ends its jobs. Why and the test: docs/design/daemon-loop.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import zmq

from dalid.protocol import (
    BatchFailed,
    BatchReady,
    Device,
    GpuUnavailable,
    Message,
    StatusReport,
    device_label,
    endpoint,
    gpu_uuid,
    slabs,
    transport,
)
from dalid.protocol.ownership import UnsafePath

from ..handling.core import DaemonCore, StopAsked
from ..handling.registration import SHARING, Sharing
from ..jobs.quotas import Quotas
from ..outputs.job_outputs import OutputsFactory
from ..outputs.shm import host_outputs
from ..outputs.store import StreamFactory, no_streams
from ..pipelines.flight import FlightRecorder
from ..pipelines.operators import OperatorPolicy
from ..pipelines.repository import PipelineRepository
from ..pipelines.spec import CpuExecutor
from .chores import Chores
from .farewell import Stop, StopKind, bound_the_stop
from .gate import DOMAIN as GATE_DOMAIN
from .gate import Gate
from .intake import (
    RECEIVE_QUEUE,
    SEND_QUEUE,
    Intake,
    IntakeLimits,
    reserve_descriptors,
)
from .reception import Reception
from .shared_socket import SharedSocket
from .socket_claim import AlreadyRunning, SocketClaim

log = logging.getLogger("dalid.server")

EXIT_ALREADY_RUNNING = 3
EXIT_NO_DEVICE = 4
# The socket's directory, or the pipeline repository, is not the user's alone (another user
# could change it: see dalid.protocol.ownership).
EXIT_UNSAFE_PATH = 5


def daemon_socket(context: zmq.Context[Any], path: Path, input_memory: int) -> zmq.Socket[Any]:
    """The daemon's ROUTER socket, bound on ``path`` behind the gate of ``context``."""
    return transport.make_socket(
        context,
        zmq.ROUTER,
        endpoint(path),
        bind=True,
        # No heartbeats: Note [No heartbeats from the daemon].
        heartbeat_ms=None,
        queue_limits=(SEND_QUEUE, RECEIVE_QUEUE),
        # ZeroMQ drops a connection that starts a frame over this, before it is read. A batch's
        # input is one frame (SPEC.md, "Batches"): one over what a message may hold but within
        # the input memory is read, and refused with a reason (intake).
        max_frame_bytes=input_memory,
        zap_domain=GATE_DOMAIN,
    )


@dataclass(frozen=True)
class DaemonConfig:
    """How to run a daemon. ``concurrency``: batches run at once across jobs (0: automatic)."""

    device: Device
    socket: Path
    idle_timeout: float | None = None
    # A pipeline repository: Python files of @pipeline_def functions clients select by name.
    pipelines: Path | None = None
    quotas: Quotas = field(default_factory=Quotas)
    concurrency: int = 0
    sharing: Sharing = SHARING
    # The DALI executor of a CPU daemon's pipelines (runner.CpuExecutor).
    cpu_executor: CpuExecutor = CpuExecutor.LEGACY
    # How GPU outputs reach trainers (staged.GPU_OUTPUT_MODES).
    gpu_outputs: str = "auto"
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    max_connections: int = IntakeLimits.max_connections
    # Which DALI operators registered pipelines may hold (operators.py).
    operators: OperatorPolicy = field(default_factory=OperatorPolicy)
    # The pid of the `dalid serve` that runs this daemon as its child (None: unsupervised).
    supervisor: int | None = None


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def automatic_concurrency() -> int:
    """Enough batches at once to keep every core busy, and two pipelines' prefetch at least."""
    return max(4, os.cpu_count() or 1)


class Daemon:
    """Serves one device until SIGTERM, SIGINT, a shutdown request or the idle timeout."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stop = threading.Event()
        # Why it stops, once asked to (farewell.py); a `shutdown` request is the core's.
        self._stop_cause: Stop | None = None
        # Set once closed: a stop that overruns its bound is ended (farewell.bound_the_stop).
        self._closed = threading.Event()
        # ZeroMQ's linger when the socket closes: none, the stop notices have left by then
        # (Note [Closing with peers connected]).
        self._linger_ms = 0
        self._reload_requested = False
        self._context: zmq.Context[Any] | None = None
        self._socket = SharedSocket(self._wake, self._deliverable, self._undelivered)
        self._monitor: zmq.Socket[Any] | None = None
        # Each message in and its answer out (reception.py), once the socket is open.
        self._reception: Reception | None = None
        # Refuses the connections of other users at the handshake (gate.py).
        self._gate: Gate | None = None
        # What each pipeline runs, for the next daemon should this one die (flight.py).
        self._flight: FlightRecorder | None = None
        # Every open connection, what it may do and who is behind it.
        self._intake: Intake | None = None
        # The socket's path: its lock file, the socket file and the GPU UUID link.
        self._claim = SocketClaim(config.socket)
        self._metrics: Any = None
        self.core: DaemonCore | None = None
        # The latest status, for the metrics endpoint's thread (replaced whole, never changed).
        self.snapshot: StatusReport | None = None

    # --- wake-ups from other threads and signals ------------------------------------------------

    def push(self, identity: bytes, message: Message, request_id: int | None = None) -> None:
        """Sends ``message`` to ``identity``, or leaves it for the loop; safe from any thread."""
        self._socket.push(identity, message, request_id)

    def request_stop(self, signum: int | None = None, _frame: object = None) -> None:
        """SIGTERM or SIGINT (None: a stop of the daemon's own, as `dalid stop` asks)."""
        if signum is None:
            self._request_stop(Stop(StopKind.REQUEST))
        else:
            self._request_stop(Stop.from_signal(signum, self.config.supervisor))

    def supervisor_gone(self, supervisor: int) -> None:
        """The supervisor ``supervisor`` died (:mod:`dalid.server.operations.lifeline`)."""
        self._request_stop(Stop(StopKind.SUPERVISOR_GONE, supervisor=supervisor))

    def _request_stop(self, stop: Stop) -> None:
        if not self._stop.is_set():
            self._stop_cause = stop
        self._stop.set()
        self._wake()

    def request_reload(self, *_: object) -> None:
        """SIGHUP: the loop reloads the pipeline repository at its next turn."""
        self._reload_requested = True
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_write(self._wake_fd, 1)

    # --- lifecycle ------------------------------------------------------------------------------

    def serve(self) -> int:
        """Runs the daemon in the calling (main) thread; returns the exit status."""
        try:
            self._claim.acquire()
        except AlreadyRunning as error:
            log.error("%s", error)
            self.close()
            return EXIT_ALREADY_RUNNING
        except UnsafePath as error:
            log.error("cannot serve: %s", error)
            self.close()
            return EXIT_UNSAFE_PATH
        try:
            # Started here, not by a signal's handler: a handler must not start threads.
            bound_the_stop(self.abandon, self._stop, self._closed)
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
            # Before the repository is first loaded: a SIGHUP that comes meanwhile loads it
            # again once the loop runs, and never ends the daemon as it would by default.
            signal.signal(signal.SIGHUP, self.request_reload)
            try:
                self._start()
            except GpuUnavailable as error:
                log.error("cannot serve GPU %s: %s", self.config.device, error)
                return EXIT_NO_DEVICE
            except UnsafePath as error:
                log.error("cannot serve: %s", error)
                return EXIT_UNSAFE_PATH
            log.info(
                "dalid daemon pid %d serving %s on %s",
                os.getpid(),
                device_label(self.config.device),
                endpoint(self.config.socket),
            )
            self._loop()
        finally:
            self.close()
        log.info("dalid daemon pid %d stopped", os.getpid())
        return 0

    def _start(self) -> None:
        config = self.config
        device_uuid = ""
        outputs: OutputsFactory = host_outputs()
        streams: StreamFactory = no_streams
        paths = None
        if config.device != "cpu":
            device_id = int(config.device)
            device_uuid = gpu_uuid(device_id)
            # Each job gets its own GPU memory, stream and events (Note [GPU output lifetime]);
            # imported here, so that a CPU daemon never loads its CUDA layer.
            from ..outputs.cuda_staged import OutputPaths
            from ..outputs.cuda_store import device_outputs, device_streams

            outputs = device_outputs(device_id)
            streams = device_streams(device_id)
            try:
                paths = OutputPaths(device_id, config.gpu_outputs)
            except Exception as error:
                raise GpuUnavailable(f"its CUDA IPC probe could not be made: {error}") from None
            log.info("GPU %d is %s; GPU outputs: %s", device_id, device_uuid, config.gpu_outputs)
        # What the previous daemon on this socket was running when it died, if it did.
        self._flight = FlightRecorder(config.socket)
        # Before the socket is bound: a client never finds a daemon whose repository is missing.
        repository = (
            PipelineRepository.load(config.pipelines) if config.pipelines is not None else None
        )
        limits = IntakeLimits(
            max_connections=reserve_descriptors(config.max_connections),
            max_message_bytes=config.quotas.input_memory // 2,
        )
        # The users whose processes it serves: its own, and root.
        served = frozenset({os.getuid(), 0})
        intake = self._intake = Intake(limits, served)
        # A daemon of root serves root alone: no other user to keep room for.
        quotas = config.quotas if len(served) > 1 else replace(config.quotas, max_jobs_per_user=0)
        self.core = DaemonCore(
            config.device,
            outputs,
            self.push,
            quotas,
            concurrency=config.concurrency or automatic_concurrency(),
            device_uuid=device_uuid,
            repository=repository,
            sharing=config.sharing,
            cpu_executor=config.cpu_executor,
            streams=streams,
            credentials=intake.credentials,
            paths=paths,
            operators=config.operators,
            recorder=self._flight,
        )
        self.snapshot = self.core.status()
        self._context = zmq.Context()
        # Before the socket binds: no connection is attached without the gate's word.
        self._gate = Gate(self._context, served)
        previous = os.umask(0o177)  # the socket file is created 0600
        try:
            sock = daemon_socket(self._context, config.socket, config.quotas.input_memory)
        finally:
            os.umask(previous)
        self._socket.open(sock)
        self._monitor = self._socket.monitor(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._reception = Reception(self._socket, self._monitor, intake, self.core)
        if config.metrics_port is not None:
            from .metrics import serve_metrics

            self._metrics = serve_metrics(
                lambda: self.snapshot, config.metrics_host, config.metrics_port
            )
            log.info("metrics on http://%s:%d/metrics", config.metrics_host, self._metrics.port)
        if device_uuid:
            self._claim.link_by_uuid(device_uuid)

    def abandon(self) -> None:
        """Removes what a stop would, for a process about to exit without one (its loop is
        stuck, see :mod:`.lifeline`); from any thread. The socket file, its lock file and the
        GPU UUID link go only while this daemon holds the lock, and the shared memory it made."""
        self._claim.abandon()
        for path, record in slabs.user_segments():
            if record.pid == os.getpid():
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Frees every job, closes the socket and removes its file. Idempotent."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        # The socket first (Note [Closing with peers connected]), its monitor with it.
        self._socket.close(self._linger_ms)
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        if self.core is not None:
            self.core.close()
            self.core = None
        if self._flight is not None:
            self._flight.close()  # a clean stop: no run was in flight
            self._flight = None
        if self._gate is not None:
            self._gate.close()
            self._gate = None
        if self._context is not None:
            self._context.term()
            self._context = None
        self._claim.close()
        if self._wake_fd >= 0:
            os.close(self._wake_fd)
            self._wake_fd = -1
        self._closed.set()
        self._stop.set()  # the stop's bound sees the daemon closed, and ends

    # --- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        assert self.core is not None and self._monitor is not None and self._intake is not None
        assert self._reception is not None
        # The socket's descriptor, not the socket (Note [Sending from an executor]).
        socket_fd = self._socket.loop_starts()
        poller = zmq.Poller()
        poller.register(socket_fd, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_fd, zmq.POLLIN)
        chores = Chores(
            self.core,
            self._intake,
            time.monotonic(),
            idle_timeout=self.config.idle_timeout,
            publish=self._publish if self._metrics is not None else None,
        )
        while not self._stop.is_set() and self.core.stop_asked is StopAsked.NO:
            # Asleep until the next thing due (Note [The loop's timers]); news wakes it sooner.
            wait_ms = chores.sleep_ms(time.monotonic(), self._intake.next_cut())
            # A message that waits already may have no news left to signal on the descriptor.
            waiting = self._socket.may_wait()
            events = dict(poller.poll(timeout=0 if waiting else wait_ms))
            if self._wake_fd in events:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake_fd)
            # Connection events first: a closed descriptor may already carry a new peer's
            # messages, and those must not be taken for the old peer's.
            if self._monitor in events:
                self._reception.connection_events()
            if waiting or socket_fd in events or self._wake_fd in events:
                self._reception.turn()
            if self._reload_requested:
                self._reload_requested = False
                self._reload()
            self._socket.flush()
            self._intake.cut_due()
            if chores.run(time.monotonic()):
                break
        self._socket.flush()
        if self._stop.is_set() or self.core.stop_asked is not StopAsked.NO:
            self._stop.set()  # the stop's bound runs from here for a `shutdown` request
            kind = (
                StopKind.END_JOBS
                if self.core.stop_asked is StopAsked.END_JOBS
                else StopKind.REQUEST
            )
            self._tell_peers(self._stop_cause or Stop(kind))
            assert self._reception is not None
            self._reception.drain(poller, self._wake_fd)

    def _tell_peers(self, stop: Stop) -> None:
        """Tells every connected peer why the daemon stops (see farewell.py)."""
        assert self.core is not None
        peers = list(self.core.peers)
        log.info("stopping (%s): telling %d connected peer(s)", stop.reason, len(peers))
        notice = stop.notice(self.config.socket)
        for identity in peers:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.send(identity, notice, None)

    def _reload(self) -> None:
        assert self.core is not None
        if self.config.pipelines is None:
            log.warning("SIGHUP: this daemon has no pipeline repository to reload (--pipelines)")
            return
        log.info("SIGHUP: reloading the pipeline repository %s", self.config.pipelines)
        self.core.reload_repository()

    def _publish(self, snapshot: StatusReport) -> None:
        self.snapshot = snapshot

    def _deliverable(self, identity: bytes, message: Message) -> bool:
        """False for a batch's result whose job ended while the batch ran: its pool is freed
        (a job ending as an executor asks may still get it, as any result on its way)."""
        core = self.core
        return not isinstance(message, BatchReady | BatchFailed) or (
            core is not None and core.job_for(identity) is not None
        )

    def _undelivered(self, identity: bytes, error: zmq.ZMQError) -> None:
        """A message could not be sent to ``identity`` (in the loop's thread)."""
        assert self._reception is not None
        self._reception.undelivered(identity, error)
