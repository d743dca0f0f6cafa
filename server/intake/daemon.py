"""The daemon process: one ROUTER socket, one I/O loop, and the core behind it.

The I/O thread receives every message; an executor sends a batch's result itself, and what
cannot leave at once waits for the loop in an outbox (:mod:`.shared_socket`). The loop waits on
the socket's descriptor and an eventfd beside it, which executors and signals write to wake it.

A peer that dies is noticed by its connection, in any pid namespace: the kernel closes a killed
process's socket at once, and ZeroMQ heartbeats close one whose process stopped answering
(frozen, or its host gone). The socket monitor reports the closed file descriptor, which the
loop maps back to the peer that last sent on it.

The loop reads at most a turn's worth of messages before it sends what is ready, and every
connection is held to its limits (:mod:`dalid.server.intake.intake`): whatever a client sends, the
daemon keeps serving the others, answers a new hello at once and stops when told to.

SIGHUP loads the pipeline repository again, as ``dalid reload`` does (the loop starts the
reload; the log tells what it loaded).

What the daemon keeps in the runtime directory (the socket's lock file, the socket file, the
GPU UUID link) is its claim on the socket's path, :mod:`dalid.server.intake.socket_claim`.

It holds the socket from bind to close (through :class:`SharedSocket`), its monitor, the
connections' intake and the loop that serves them.

Note [A routing id claimed twice]
---------------------------------
No connection of another user has a queue in the socket, and no message under a routing id is
handled from any connection or process but the one that used it first: libzmq 4.3.5 aborts
the process when a connection claims a routing id in use, sends more than its queue holds and
closes. The gate (:mod:`.gate`) refuses other users at the handshake; the intake
(:mod:`.intake`) binds each routing id to its first connection and process. Why, what it
leaves open, and the tests: docs/design/daemon-loop.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from dalid.protocol import (
    BatchFailed,
    BatchReady,
    Device,
    Error,
    GpuUnavailable,
    Message,
    ProtocolError,
    StatusReport,
    decode,
    device_label,
    endpoint,
    gpu_uuid,
    slabs,
    transport,
)
from dalid.protocol.ownership import UnsafePath

from ..handling.core import DaemonCore
from ..handling.registration import SHARING, Sharing
from ..jobs.quotas import Quotas
from ..outputs.outputs import OutputsFactory, StreamFactory, no_streams
from ..outputs.shm import host_outputs
from ..pipelines.flight import FlightRecorder
from ..pipelines.operators import OperatorPolicy
from ..pipelines.repository import PipelineRepository
from ..runs import wakes
from .credentials import from_message
from .farewell import NOTICE_LINGER_MS, stop_reason, stopping_notice
from .gate import DOMAIN as GATE_DOMAIN
from .gate import Gate
from .heap import HeapKeeper, give_back_free_memory
from .intake import (
    RECEIVE_QUEUE,
    SEND_QUEUE,
    TURN_MESSAGES,
    TURN_SECONDS,
    Intake,
    IntakeLimits,
    Verdict,
    reserve_descriptors,
)
from .shared_socket import SharedSocket
from .socket_claim import AlreadyRunning, SocketClaim

log = logging.getLogger("dalid.server")

EXIT_ALREADY_RUNNING = 3
EXIT_NO_DEVICE = 4
# The socket's directory, or the pipeline repository, is not the user's alone (another user
# could change it: see dalid.protocol.ownership).
EXIT_UNSAFE_PATH = 5
# ZeroMQ heartbeats: a peer that answers none for HEARTBEAT_TIMEOUT_MS after one is sent is
# dropped, so a frozen client is freed within about 4 s.
HEARTBEAT_INTERVAL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
# Batch inputs freed since the last time, past which the loop gives the heap's free memory back.
TRIM_AFTER_BYTES = 16 << 20
# Answers that count against a connection's limits (Daemon._answer).
_REFUSALS = (Error, BatchFailed)
_SRCFD = int(zmq.SRCFD)
# How often the status snapshot that the metrics endpoint serves is refreshed (only while the
# daemon serves metrics).
SNAPSHOT_INTERVAL_S = 1.0


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
    # How GPU outputs reach trainers (staged.GPU_OUTPUT_MODES).
    gpu_outputs: str = "auto"
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    max_connections: int = IntakeLimits.max_connections
    # Which DALI operators registered pipelines may hold (operators.py).
    operators: OperatorPolicy = field(default_factory=OperatorPolicy)


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def automatic_concurrency() -> int:
    """Enough batches at once to keep every core busy, and two pipelines' prefetch at least."""
    return max(4, os.cpu_count() or 1)


# Note [The loop's timers]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The loop wakes for news or when a timed chore is due, never on a fixed tick: its poll sleeps
# until the first chore's time (``sleep_ms``), and what must be seen at once comes as news (a
# message, a monitor event, a write to the eventfd). Why, and the tests that hold it:
# docs/design/daemon-loop.md.


def sleep_ms(now: float, reap_at: float, *due: float | None, cut_in: float | None = None) -> int:
    """How long the loop may sleep, in ms rounded up: until the reap, or the first other time
    in ``due`` that is set (monotonic seconds), or ``cut_in`` seconds from now if sooner."""
    wake_at = min([reap_at, *(t for t in due if t is not None)])
    wait_s = wake_at - now if cut_in is None else min(wake_at - now, cut_in)
    return max(0, int(wait_s * 1000) + 1)


class Daemon:
    """Serves one device until SIGTERM, SIGINT, a shutdown request or the idle timeout."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stop = threading.Event()
        self._stop_signal: int | None = None
        # ZeroMQ's linger when the socket closes: long enough for the stop notices to leave.
        self._linger_ms = 0
        self._reload_requested = False
        self._context: zmq.Context[Any] | None = None
        self._socket = SharedSocket(self._wake, self._deliverable, self._undelivered)
        self._monitor: zmq.Socket[Any] | None = None
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
        if not self._stop.is_set():
            self._stop_signal = signum
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
            from ..outputs.cuda import device_outputs, device_streams
            from ..outputs.cuda_staged import OutputPaths

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
        self.core = DaemonCore(
            config.device,
            outputs,
            self.push,
            config.quotas,
            concurrency=config.concurrency or automatic_concurrency(),
            device_uuid=device_uuid,
            repository=repository,
            sharing=config.sharing,
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
            sock = transport.make_socket(
                self._context,
                zmq.ROUTER,
                endpoint(config.socket),
                bind=True,
                heartbeat_ms=(HEARTBEAT_INTERVAL_MS, HEARTBEAT_TIMEOUT_MS),
                queue_limits=(SEND_QUEUE, RECEIVE_QUEUE),
                # ZeroMQ drops a connection that starts a frame over this, before it is read. A
                # batch's input is one frame (SPEC.md, "Batches"): one over what a message may
                # hold but within the input memory is read, and refused with a reason (intake).
                max_frame_bytes=config.quotas.input_memory,
                zap_domain=GATE_DOMAIN,
            )
        finally:
            os.umask(previous)
        self._socket.open(sock)
        self._monitor = self._socket.monitor(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
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
        if self.core is not None:
            self.core.close()
            self.core = None
        if self._flight is not None:
            self._flight.close()  # a clean stop: no run was in flight
            self._flight = None
        self._socket.close(self._linger_ms)
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
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

    # --- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        assert self.core is not None and self._monitor is not None and self._intake is not None
        # The socket's descriptor, not the socket (Note [Sending from an executor]).
        socket_fd = self._socket.loop_starts()
        poller = zmq.Poller()
        poller.register(socket_fd, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_fd, zmq.POLLIN)
        next_reap = time.monotonic() + 1.0
        # A job that ended, a connection cut, or batch inputs freed (by executors that stop
        # late too) since the last trim leave freed memory to give back. Counted, not sampled
        # once a tick: a flooding job may come, be cut and go within one.
        departures = self._departures()
        inputs_peak = self.core.inputs.held
        # And while jobs run, whenever the heap's resident memory has grown (heap.py).
        heap = HeapKeeper(trim=give_back_free_memory)
        next_snapshot = time.monotonic() + SNAPSHOT_INTERVAL_S
        idle_since: float | None = time.monotonic()
        timeout = self.config.idle_timeout
        while not self._stop.is_set() and not self.core.stop_requested:
            # Asleep until the next thing due (Note [The loop's timers]); news wakes it sooner.
            wait_ms = sleep_ms(
                time.monotonic(),
                next_reap,
                next_snapshot if self._metrics is not None else None,
                idle_since + timeout if timeout is not None and idle_since is not None else None,
                cut_in=self._intake.next_cut(),
            )
            # A message that waits already may have no news left to signal on the descriptor.
            waiting = self._socket.may_wait()
            events = dict(poller.poll(timeout=0 if waiting else wait_ms))
            if self._wake_fd in events:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake_fd)
            # Connection events first: a closed descriptor may already carry a new peer's
            # messages, and those must not be taken for the old peer's.
            if self._monitor in events:
                self._connection_events()
            if waiting or socket_fd in events or self._wake_fd in events:
                self._receive_turn()
            if self._reload_requested:
                self._reload_requested = False
                self._reload()
            self._socket.flush()
            self._intake.cut_due()
            now = time.monotonic()
            if now >= next_reap:
                self.core.reap()
                next_reap = now + 1.0
                inputs_peak = max(inputs_peak, self.core.inputs.take_peak())
                held = self.core.inputs.held
                if departures != self._departures() or inputs_peak - held >= TRIM_AFTER_BYTES:
                    heap.trim()
                    departures = self._departures()
                    inputs_peak = held
                else:
                    heap.check()
            if self._metrics is not None and now >= next_snapshot:
                # Only the metrics endpoint reads it: without one, the status is made when asked.
                self.snapshot = self.core.status()
                next_snapshot = now + SNAPSHOT_INTERVAL_S
            if self.core.jobs:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            if timeout is not None and idle_since is not None and now - idle_since >= timeout:
                log.info("no jobs for %.0f s: exiting", timeout)
                break
        self._socket.flush()
        if self._stop.is_set() or self.core.stop_requested:
            self._tell_peers(stop_reason(self._stop_signal))

    def _tell_peers(self, reason: str) -> None:
        """Tells every connected peer that the daemon was stopped (see farewell.py)."""
        assert self.core is not None
        peers = list(self.core.peers)
        log.info("stopping (%s): telling %d connected peer(s)", reason, len(peers))
        notice = stopping_notice(self.config.socket, reason)
        for identity in peers:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.send(identity, notice, None)
        if peers:
            self._linger_ms = NOTICE_LINGER_MS

    def _reload(self) -> None:
        assert self.core is not None
        if self.config.pipelines is None:
            log.warning("SIGHUP: this daemon has no pipeline repository to reload (--pipelines)")
            return
        log.info("SIGHUP: reloading the pipeline repository %s", self.config.pipelines)
        self.core.reload_repository()

    def _departures(self) -> int:
        """Jobs ended and cut connections gone, so far."""
        assert self.core is not None and self._intake is not None
        return self.core.registry.ended + self._intake.cuts

    def _receive_turn(self) -> None:
        """Handles the messages that are in, up to a turn's worth (ZeroMQ hands them over one
        connection after the other); the rest wait for the next turn, after the loop has sent
        what is ready. Executors the turn's messages woke wake after its answers are sent
        (Note [Waking executors after the turn's answers] in wakes.py)."""
        deadline = time.monotonic() + TURN_SECONDS
        with wakes.turn():
            for _ in range(TURN_MESSAGES):
                frames = self._socket.receive()
                if frames is None:
                    return
                self._receive(frames)
                if time.monotonic() >= deadline:
                    return

    def _receive(self, frames: list[zmq.Frame]) -> None:
        assert self.core is not None and self._intake is not None
        identity = frames[0].bytes
        if len(frames) < 2:
            return  # ZeroMQ hands over no empty message
        if not self._intake.knows(identity):
            # A peer's first message. A descriptor is reused as soon as it is closed. ZeroMQ
            # reports the close to the monitor before it accepts the connection that reuses
            # the descriptor, so handling the reports that are in now keeps an old peer's close
            # from being taken for this sender's.
            self._connection_events()
        # Every message names its connection and its sender's process, which bind its identity
        # (the intake refuses one that another connection used first).
        message = frames[1:]
        first = message[0]
        verdict = self._intake.admit(
            identity, first.get(_SRCFD), sum(map(len, message)), from_message(first)
        )
        if verdict is Verdict.DROP:
            return
        if not isinstance(verdict, Verdict):
            self._socket.send(identity, verdict, None)
            return
        try:
            envelope = decode(message)
        except ProtocolError as error:
            if self._intake.log_refusal(identity):
                log.warning("malformed message from %s: %s", identity.hex(), error.message)
            self._answer(identity, self.core.malformed(error), error.request_id)
            return
        reply = self.core.handle(identity, envelope.message, envelope.request_id)
        if reply is not None:
            self._answer(identity, reply, envelope.request_id)

    def _answer(self, identity: bytes, reply: Message, request_id: int | None) -> None:
        """Sends a reply; a refusal counts against the connection's limits (a batch refused
        once sent is answered ``batch_failed``: a refusal too)."""
        assert self._intake is not None
        self._socket.send(identity, reply, request_id)
        if isinstance(reply, _REFUSALS):
            cut = self._intake.refused(identity, reply)
            if cut is not None:
                self._socket.send(identity, cut, None)

    def _connection_events(self) -> None:
        assert self._monitor is not None and self.core is not None and self._intake is not None
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            # For these two events the value is the connection's file descriptor.
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                gone = self._intake.accepted(fd)
            else:
                gone = self._intake.closed(fd)
            if gone is not None:
                self.core.peer_disconnected(gone)

    def _deliverable(self, identity: bytes, message: Message) -> bool:
        """False for a batch's result whose job ended while the batch ran: its pool is freed.

        An executor asks without the loop's order, so a job that ends at that moment may still
        get the result; its trainer, leaving or gone, could as well have had it a moment
        earlier, and reads it as any result that was on its way when it left."""
        core = self.core
        return not isinstance(message, BatchReady | BatchFailed) or (
            core is not None and core.job_for(identity) is not None
        )

    def _undelivered(self, identity: bytes, error: zmq.ZMQError) -> None:
        """A message could not be sent to ``identity`` (in the loop's thread)."""
        assert self.core is not None and self._intake is not None
        if isinstance(error, zmq.Again):
            # Its queue is full: the peer does not read what it is sent.
            self._intake.unreachable(identity)
        elif error.errno == zmq.EHOSTUNREACH:
            self.core.trainer_unreachable(identity)
        else:
            raise error
