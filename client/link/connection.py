"""One DEALER connection to a daemon, for one process: hello, requests, pushes, goodbye.
Whether the daemon behind it lives is its watch's (``watch.py``).

A connection belongs to the process that opened it. After a fork the child must open its own:
ZeroMQ sockets and contexts are not fork-safe, so a connection refuses to be used from another
pid, and :func:`process_context` gives each process a context of its own.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from dalid.protocol import (
    PROTOCOL_VERSION,
    EarlierJob,
    Envelope,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    Message,
    Ping,
    Pong,
    ProtocolError,
    Role,
    Welcome,
    daemon_socket,
    endpoint,
    pid_namespace,
    transport,
)

from ..errors import (
    DaemonStopped,
    DaemonUnavailable,
    JobEnded,
    ProtocolMismatch,
    ended_notice,
    error_from_reply,
    stopped_error,
)
from .advice import NO_ADVICE, Advice
from .watch import NOTICE_GRACE_MS, DaemonWatch, Silence

log = logging.getLogger("dalid.client")

# While a trainer waits for a batch, its ``idle`` work (returning the regions of tensors that
# other threads dropped meanwhile, progress reports) runs this often. Each wake-up costs the
# trainer CPU, and more of them the longer a batch takes: at 50 ms, four jobs sharing the
# daemon woke each trainer several times a batch for nothing.
IDLE_EVERY_S = 0.25
# How often a socket that nothing listens on yet is tried again.
CONNECT_RETRY_S = 0.05

_context: zmq.Context[Any] | None = None
_context_pid = -1

# This process's pid, kept current in a forked child: os.getpid() is a system call, and the
# fork checks below run on every message a connection sends or receives.
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def this_pid() -> int:
    """This process's pid (``os.getpid()``, without a system call)."""
    return _pid


def process_context() -> zmq.Context[Any]:
    """This process's ZeroMQ context (a forked child gets a new one)."""
    global _context, _context_pid
    if _context is None or _context_pid != os.getpid():
        _context = zmq.Context()
        _context_pid = os.getpid()
    return _context


def stop_notice(envelope: Envelope, then: str) -> DaemonStopped | None:
    """The error for a daemon's notice that it stops (see dalid.server.intake.farewell), ending
    with ``then``, what this link's user can do next."""
    message = envelope.message
    if (
        envelope.request_id is None
        and isinstance(message, Error)
        and message.code is ErrorCode.SHUTTING_DOWN
    ):
        return stopped_error(message, then)
    return None


def job_ended(envelope: Envelope) -> JobEnded | None:
    """The error for a daemon's notice that it ended this link's job (an idle one, to make
    room for another: dalid.server.jobs.reclaim)."""
    message = envelope.message
    if envelope.request_id is None and isinstance(message, Error):
        return ended_notice(message)
    return None


def no_daemon_message(path: Path, device: str | int, advice: Advice) -> str:
    return f"no dalid daemon answers on {endpoint(path)}: {advice.start_one(path, device)}"


def _verified_socket(path: Path, device: str | int, timeout: float, advice: Advice) -> Path:
    """The socket to connect to for ``path``, once it is known to be the user's daemon's
    (UnsafePath, a PermissionError, otherwise). A daemon that is not listening yet (being
    restarted, say) is waited for up to ``timeout``, as a hello is."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return daemon_socket.verified_socket(path, max(0.1, deadline - time.monotonic()))
        except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
            if time.monotonic() >= deadline:
                raise DaemonUnavailable(
                    f"no dalid daemon answers on {endpoint(path)} (nothing listened on it "
                    f"within {timeout:.0f} s): {advice.start_one(path, device)}"
                ) from None
            time.sleep(CONNECT_RETRY_S)


class Connection:
    """A DEALER socket that has been welcomed by the daemon on ``path``.

    ``on_push`` receives every message that is not the reply being waited for (batch results,
    errors about notifications). A trainer's connection asks for its job's ``weight``,
    ``memory_bytes`` and ``max_inflight_batches`` (0: the daemon's default), and names the jobs
    it had on earlier daemons (``earlier_jobs``) so that their workers join its new job.
    """

    def __init__(
        self,
        path: Path,
        role: Role,
        *,
        device: str | int = "cpu",
        name: str = "",
        job_id: int | None = None,
        job_token: str | None = None,
        on_push: Callable[[Envelope], None] | None = None,
        hello_timeout: float = 5.0,
        weight: float = 1.0,
        memory_bytes: int = 0,
        max_inflight_batches: int = 0,
        earlier_jobs: tuple[EarlierJob, ...] = (),
        advice: Advice = NO_ADVICE,
    ) -> None:
        self.path = path
        self.device = device
        self.advice = advice
        self._pid = os.getpid()
        self._on_push = on_push or self._log_push
        self._request_ids = itertools.count(1)
        # Whether the welcomed daemon lives: its pid, pongs and the drop monitor.
        self._watch = DaemonWatch(path, advice)
        # The hello may carry a job token: it goes only to the user's own daemon.
        target = _verified_socket(path, device, hello_timeout, advice)
        self._socket: zmq.Socket[Any] | None = transport.make_socket(
            process_context(), zmq.DEALER, endpoint(target), bind=False
        )
        # One poller for the connection's life: Socket.poll would make one per wait.
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        if role is Role.TRAINER:
            # A trainer's job ends with a dropped connection: its watch tells (watch.py).
            self._watch.watch_drops(self._socket)
        try:
            hello = Hello(
                protocol_version=PROTOCOL_VERSION,
                client_pid=os.getpid(),
                role=role,
                pid_namespace=pid_namespace(),
                name=name,
                job_id=job_id,
                job_token=job_token,
                weight=weight,
                memory_bytes=memory_bytes,
                max_inflight_batches=max_inflight_batches,
                earlier_jobs=earlier_jobs,
                private_copies=role is Role.TRAINER,
                device_copies=role is Role.TRAINER,
            )
            reply = self.request(hello, timeout=hello_timeout, ping=False)
        except BaseException:
            # A constructor that fails half-way closes what it opened.
            self.abort()
            raise
        assert isinstance(reply, Welcome)
        self.welcome: Welcome = reply
        self._watch.welcomed(reply)

    @property
    def closed(self) -> bool:
        return self._socket is None

    def request(
        self, message: Message, timeout: float | None = None, *, ping: bool = True
    ) -> Message:
        """Sends a request and returns its reply; an error reply is raised as a DalidError."""
        return self.reply(self.send(message), message.OP, timeout, ping=ping)

    def send(self, message: Message) -> int:
        """Sends a request whose reply :meth:`reply` waits for; returns its request id."""
        request_id = next(self._request_ids)
        self._send(message, request_id)
        return request_id

    def reply(
        self, request_id: int, op: str, timeout: float | None = None, *, ping: bool = True
    ) -> Message:
        """The reply to the request ``op`` sent as ``request_id``; an error reply is raised."""
        envelope = self.receive_until(lambda e: e.request_id == request_id, timeout, ping=ping)
        if envelope is None:
            raise DaemonUnavailable(
                f"the dalid daemon on {endpoint(self.path)} did not reply to {op} within "
                f"{timeout:.0f} s: it is stuck or overloaded (`dalid status --socket {self.path}` "
                "shows whether it answers; its log says more)"
            )
        if isinstance(envelope.message, Error):
            daemon_pid = self._watch.daemon_pid
            if daemon_pid and envelope.message.code is ErrorCode.NOT_WELCOMED:
                # A welcomed connection is unknown to the daemon when its job ended, or when
                # another daemon answers on the socket now.
                if self._answering_pid() == daemon_pid:
                    raise DaemonUnavailable(
                        f"the dalid daemon on {endpoint(self.path)} (pid {daemon_pid}) "
                        f"ended job {self.welcome.job_id}, which this connection belonged to: "
                        "its trainer closed its session or exited"
                    )
                raise self.gone_error("another daemon now answers on its socket (it was restarted)")
            raise error_from_reply(envelope.message)
        return envelope.message

    def _answering_pid(self, timeout: float = 2.0) -> int | None:
        """The pid of the daemon that answers a ping on the socket now (None: none does)."""
        ping_id = self._ping()
        envelope = self.receive_until(lambda e: e.request_id == ping_id, timeout, ping=False)
        if envelope is None or not isinstance(envelope.message, Pong):
            return None
        return envelope.message.daemon_pid

    def _ping(self) -> int:
        """Sends a ping; returns its request id."""
        ping_id = next(self._request_ids)
        self._send(Ping(), ping_id)
        return ping_id

    def notify(self, message: Message) -> None:
        """Sends a message that gets no reply."""
        self._send(message, None)

    def receive_until(
        self,
        done: Callable[[Envelope], bool],
        timeout: float | None,
        *,
        ping: bool = True,
        idle: Callable[[], None] | None = None,
    ) -> Envelope | None:
        """Receives until a message satisfies ``done`` (returned) or ``timeout`` passes (None).

        Other messages go to ``on_push``. ``idle`` runs after each poll that found nothing (a
        wait of IDLE_EVERY_S). With ``ping``, a daemon that stays silent is pinged, and one that
        does not answer raises DaemonUnavailable.
        """
        sock = self._live_socket()
        deadline = None if timeout is None else time.monotonic() + timeout
        silence = Silence(self._watch, ping, time.monotonic())
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            wait = IDLE_EVERY_S if idle is not None else 0.5
            if deadline is not None:
                wait = min(wait, deadline - now)
            if not self._poller.poll(int(wait * 1000) + 1):
                if idle is not None:
                    idle()
                if self._watch.dropped():
                    raise self._watch.dropped_error(self._answering_pid, self.welcome.job_id)
                silence.quiet(
                    time.monotonic(), self._ping, lambda: bool(sock.poll(NOTICE_GRACE_MS))
                )
                continue
            envelope = self._recv(sock)
            silence.heard(time.monotonic())
            stopped = stop_notice(envelope, self.advice.after_stop(self.path, self.device))
            if stopped is not None:
                self._watch.gone = True
                raise stopped
            ended = job_ended(envelope)
            if ended is not None:
                self._watch.gone = True  # its job, not the daemon: no goodbye is due
                raise ended
            if silence.answers_ping(envelope):
                continue
            if done(envelope):
                return envelope
            self._on_push(envelope)

    def close(self, goodbye: bool = True, kept_slabs: tuple[str, ...] = ()) -> None:
        """Says goodbye (briefly waiting for the answer) and closes. Idempotent.

        ``kept_slabs``: the GPU slabs this trainer still maps (see ``Goodbye``).
        """
        if self._socket is None:
            return
        if goodbye and self._pid == os.getpid() and not self._watch.gone:
            try:
                request_id = self.send(Goodbye(kept_slabs))
                # Any answer ends it. An error is not looked into as a request's is: for a
                # goodbye, ``not_welcomed`` (the daemon ended this connection's job already)
                # means done, and asking which daemon answers would cost the daemon a ping.
                answer = self.receive_until(lambda e: e.request_id == request_id, 2.0, ping=False)
                if answer is None or isinstance(answer.message, Error):
                    log.debug("goodbye: %s", "no answer" if answer is None else answer.message)
            except Exception as error:  # closing must not fail because the daemon is gone
                log.debug("goodbye not answered: %s", error)
        self.abort()

    def abort(self) -> None:
        """Closes the socket now, without a goodbye. Idempotent."""
        sock, self._socket = self._socket, None
        owned = self._pid == os.getpid()
        self._watch.close(sock, owned=owned)
        if owned and sock is not None:
            sock.close(linger=0)

    def gone_error(self, why: str) -> DaemonUnavailable:
        """The error for a daemon found gone, saying ``why`` and what to do. From then on
        ``close`` waits for no goodbye."""
        return self._watch.gone_error(why)

    def _live_socket(self) -> zmq.Socket[Any]:
        if self._socket is None:
            raise DaemonUnavailable(f"the connection to {endpoint(self.path)} is closed")
        if self._pid != _pid:
            raise RuntimeError(
                "a dalid connection was used in a forked child: each process opens its own"
            )
        return self._socket

    def _send(self, message: Message, request_id: int | None) -> None:
        transport.send(self._live_socket(), message, request_id)

    def _recv(self, sock: zmq.Socket[Any]) -> Envelope:
        try:
            return transport.recv(sock)
        except ProtocolError as error:
            if error.code.value == "protocol_mismatch":
                raise ProtocolMismatch(error.message) from None
            raise DaemonUnavailable(f"malformed message from the daemon: {error}") from None

    @staticmethod
    def _log_push(envelope: Envelope) -> None:
        if isinstance(envelope.message, Error):
            log.warning("dalid daemon: %s", envelope.message.message)
        else:
            log.debug("ignored %s", envelope.message.OP)
