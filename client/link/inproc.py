"""The in-process link: a daemon's core served in this process, reached without a socket.

What vLLM calls an in-process client: the client's logic (sessions, workers, reconnection)
runs unchanged against a daemon core called directly, so it can be driven and checked without
processes or sockets. The client never imports the daemon: whoever serves one here hands
:class:`InprocDaemon` the core's entry points as callables (``handle`` a message, a peer
``disconnected``) and gives the core :meth:`InprocDaemon.push` to send its results.

Messages go through the codec both ways and every frame is copied, as a socket would, so a
message behaves as on the wire: nothing is shared between the two sides, and what the codec
refuses is refused here too. A daemon served here answers only the process that serves it
(a forked DataLoader worker cannot reach it).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from dalid.protocol import (
    PROTOCOL_VERSION,
    EarlierJob,
    Envelope,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    Message,
    ProtocolError,
    Role,
    Welcome,
    decode,
    encode,
    pid_namespace,
)

from ..errors import DaemonUnavailable, ProtocolMismatch, error_from_reply
from .advice import NO_ADVICE, Advice
from .connection import IDLE_EVERY_S, job_ended, stop_notice
from .watch import DaemonWatch

log = logging.getLogger("dalid.client")

Frames = list[bytearray]


class Handler(Protocol):
    def __call__(
        self, identity: bytes, message: Message, request_id: int | None
    ) -> Message | None: ...


_served: dict[Path, InprocDaemon] = {}
_served_lock = threading.Lock()


def served_at(path: Path) -> InprocDaemon | None:
    """The daemon served in this process on ``path``, if any."""
    with _served_lock:
        daemon = _served.get(path.absolute())
    if daemon is not None and daemon.pid != os.getpid():
        raise DaemonUnavailable(
            f"the dalid daemon on {path} is served in process {daemon.pid}, and only that "
            "process can reach it: use num_workers=0, or a daemon process (`dalid serve`)"
        )
    return daemon


class InprocDaemon:
    """A daemon core served on ``path`` to links in this process: what the daemon's socket
    and I/O loop do for a core. Each link has an identity and an inbox of frames.

    ``handle`` runs in the sending link's thread, one message at a time (as the daemon's one
    I/O thread runs it); ``push`` may be called from any thread.
    """

    def __init__(self, path: Path) -> None:
        self.path = path.absolute()
        self.pid = os.getpid()
        self.closed = False
        self._handle: Handler | None = None
        self._disconnected: Callable[[bytes], None] | None = None
        self._handling = threading.Lock()
        self._inboxes_lock = threading.Lock()
        self._inboxes: dict[bytes, queue.SimpleQueue[Frames]] = {}
        self._identities = itertools.count(1)

    def serve(self, handle: Handler, disconnected: Callable[[bytes], None]) -> None:
        """Answers on ``path`` from now on, through the core's ``handle`` and
        ``disconnected`` (a link that closed, as the socket monitor reports one)."""
        with _served_lock:
            if _served.get(self.path) not in (None, self):
                raise RuntimeError(
                    f"a dalid daemon is already served in this process on {self.path}"
                )
            self._handle, self._disconnected = handle, disconnected
            _served[self.path] = self

    def push(self, identity: bytes, message: Message, request_id: int | None = None) -> None:
        """Sends ``message`` to the link ``identity``; dropped if it has gone. Thread-safe."""
        frames = _copied(encode(message, request_id))
        with self._inboxes_lock:
            inbox = self._inboxes.get(identity)
        if inbox is not None and not self.closed:
            inbox.put(frames)

    def close(self) -> None:
        """Stops answering: links find the daemon gone, as if its process had died. Idempotent."""
        self.closed = True
        with _served_lock:
            if _served.get(self.path) is self:
                del _served[self.path]
        with self._inboxes_lock:
            self._inboxes.clear()

    # --- what the links call ---------------------------------------------------------------------

    def connect(self) -> tuple[bytes, queue.SimpleQueue[Frames]]:
        """A new link's identity and inbox."""
        identity = f"inproc-{next(self._identities)}".encode()
        inbox: queue.SimpleQueue[Frames] = queue.SimpleQueue()
        with self._inboxes_lock:
            self._inboxes[identity] = inbox
        return identity, inbox

    def receive(self, identity: bytes, frames: Frames) -> None:
        """One message from a link: decoded, handled, and its reply (if any) pushed back."""
        if self.closed:
            return  # gone: what is sent to a dead daemon is lost
        try:
            envelope = decode(frames)
        except ProtocolError as error:
            self.push(identity, Error(error.code, error.message, op=error.op), error.request_id)
            return
        assert self._handle is not None, "serve() the daemon before links reach it"
        with self._handling:
            reply = self._handle(identity, envelope.message, envelope.request_id)
        if reply is not None:
            self.push(identity, reply, envelope.request_id)

    def disconnect(self, identity: bytes) -> None:
        """A link closed: the core lets go of its peer, as the daemon does of a closed socket."""
        with self._inboxes_lock:
            known = self._inboxes.pop(identity, None) is not None
        if known and not self.closed and self._disconnected is not None:
            with self._handling:
                self._disconnected(identity)


def _copied(frames: list[Any]) -> Frames:
    """The frames as a receiver gets them from a socket: writable copies, sharing nothing
    with the sender's buffers."""
    return [bytearray(memoryview(frame)) for frame in frames]


class InprocLink:
    """A :class:`~dalid.client.link.link.Link` to a daemon served in this process, welcomed in
    ``role``; it takes the options of :class:`~dalid.client.link.connection.Connection`'s hello."""

    def __init__(
        self,
        daemon: InprocDaemon,
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
        self._daemon = daemon
        self._pid = os.getpid()
        self._on_push = on_push or _log_push
        self._request_ids = itertools.count(1)
        # Whether the daemon was found gone, or ended this link's job: no goodbye is due then.
        self._watch = DaemonWatch(path, advice)
        self._identity: bytes | None
        self._identity, self._inbox = daemon.connect()
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
            reply = self.request(hello, timeout=hello_timeout)
        except BaseException:
            self.abort()
            raise
        assert isinstance(reply, Welcome)
        self.welcome: Welcome = reply
        self._watch.welcomed(reply)

    @property
    def closed(self) -> bool:
        return self._identity is None

    def request(self, message: Message, timeout: float | None = None) -> Message:
        return self.reply(self.send(message), message.OP, timeout)

    def send(self, message: Message) -> int:
        request_id = next(self._request_ids)
        self._send(message, request_id)
        return request_id

    def reply(self, request_id: int, op: str, timeout: float | None = None) -> Message:
        envelope = self.receive_until(lambda e: e.request_id == request_id, timeout)
        if envelope is None:
            raise DaemonUnavailable(
                f"the dalid daemon on {self.path} (in this process) did not answer "
                f"{op} in {timeout:.0f} s"
            )
        if isinstance(envelope.message, Error):
            if self._watch.daemon_pid and envelope.message.code is ErrorCode.NOT_WELCOMED:
                # A welcomed link is unknown to the daemon only if it is another one.
                raise self.gone_error("another daemon now answers on its path")
            raise error_from_reply(envelope.message)
        return envelope.message

    def notify(self, message: Message) -> None:
        self._send(message, None)

    def receive_until(
        self,
        done: Callable[[Envelope], bool],
        timeout: float | None,
        *,
        idle: Callable[[], None] | None = None,
    ) -> Envelope | None:
        inbox = self._live_inbox()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            wait = IDLE_EVERY_S if idle is not None else 0.5
            if deadline is not None:
                wait = min(wait, deadline - now)
            try:
                frames = inbox.get(timeout=wait)
            except queue.Empty:
                if self._daemon.closed:
                    raise self.gone_error("it was stopped") from None
                if idle is not None:
                    idle()
                continue
            try:
                envelope = decode(frames)
            except ProtocolError as error:
                if error.code is ErrorCode.PROTOCOL_MISMATCH:
                    raise ProtocolMismatch(error.message) from None
                raise DaemonUnavailable(f"malformed message from the daemon: {error}") from None
            # A notice that the daemon stops, then one that it ended this job, as over a socket.
            stopped = stop_notice(envelope, self.advice.after_stop(self.path, self.device))
            if stopped is not None:
                self._watch.gone = True
                raise stopped
            ended = job_ended(envelope)
            if ended is not None:
                self._watch.gone = True  # its job, not the daemon: no goodbye is due
                raise ended
            if done(envelope):
                return envelope
            self._on_push(envelope)

    def close(self, goodbye: bool = True, kept_slabs: tuple[str, ...] = ()) -> None:
        if self._identity is None:
            return
        if goodbye and self._pid == os.getpid() and not self._watch.gone:
            try:
                self.request(Goodbye(kept_slabs), timeout=2.0)
            except Exception as error:  # closing must not fail because the daemon is gone
                log.debug("goodbye not answered: %s", error)
        self.abort()

    def abort(self) -> None:
        identity, self._identity = self._identity, None
        if identity is not None and self._pid == os.getpid():
            self._daemon.disconnect(identity)

    def gone_error(self, why: str) -> DaemonUnavailable:
        return self._watch.gone_error(f"{why} (it was served in this process)")

    def _live_inbox(self) -> queue.SimpleQueue[Frames]:
        if self._identity is None:
            raise DaemonUnavailable(f"the connection to {self.path} is closed")
        if self._pid != os.getpid():
            raise RuntimeError(
                "a dalid connection was used in a forked child: each process opens its own"
            )
        return self._inbox

    def _send(self, message: Message, request_id: int | None) -> None:
        self._live_inbox()
        assert self._identity is not None
        self._daemon.receive(self._identity, _copied(encode(message, request_id)))


def _log_push(envelope: Envelope) -> None:
    if isinstance(envelope.message, Error):
        log.warning("dalid daemon: %s", envelope.message.message)
    else:
        log.debug("ignored %s", envelope.message.OP)
