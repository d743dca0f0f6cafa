"""The daemon's reception: each message in, through the intake, to the core, and its answer out.

:class:`Reception` reads the socket a turn at a time for the daemon's loop
(:mod:`dalid.server.intake.daemon`), maps the monitor's connection events onto peers, admits
every message through the connection's limits (:mod:`.intake`), decodes it, has the core
handle it and sends the answer; a refusal counts against the connection.

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
import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from dalid.protocol import BatchFailed, Error, Message, ProtocolError, decode

from ..handling.core import DaemonCore
from ..runs import wakes
from .credentials import from_message
from .farewell import NOTICE_LINGER_MS
from .intake import TURN_MESSAGES, TURN_SECONDS, Intake, Verdict
from .shared_socket import SharedSocket

log = logging.getLogger("dalid.server")

# Answers that count against a connection's limits (Reception.answer).
_REFUSALS = (Error, BatchFailed)
_SRCFD = int(zmq.SRCFD)


class Reception:
    """Receives and answers the messages of ``socket``'s connections (the loop's thread)."""

    def __init__(
        self, socket: SharedSocket, monitor: zmq.Socket[Any], intake: Intake, core: DaemonCore
    ) -> None:
        self._socket = socket
        self._monitor = monitor
        self._intake = intake
        self._core = core

    def turn(self) -> None:
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
        identity = frames[0].bytes
        if len(frames) < 2:
            return  # ZeroMQ hands over no empty message
        if not self._intake.knows(identity):
            # A peer's first message. A descriptor is reused as soon as it is closed. ZeroMQ
            # reports the close to the monitor before it accepts the connection that reuses
            # the descriptor, so handling the reports that are in now keeps an old peer's close
            # from being taken for this sender's.
            self.connection_events()
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
            self.answer(identity, self._core.malformed(error), error.request_id)
            return
        reply = self._core.handle(identity, envelope.message, envelope.request_id)
        if reply is not None:
            self.answer(identity, reply, envelope.request_id)

    def answer(self, identity: bytes, reply: Message, request_id: int | None) -> None:
        """Sends a reply; a refusal counts against the connection's limits (a batch refused
        once sent is answered ``batch_failed``: a refusal too)."""
        self._socket.send(identity, reply, request_id)
        if isinstance(reply, _REFUSALS):
            cut = self._intake.refused(identity, reply)
            if cut is not None:
                self._socket.send(identity, cut, None)

    def connection_events(self) -> None:
        """Maps the monitor's reports of connections accepted and closed onto peers."""
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
                self._core.peer_disconnected(gone)

    def undelivered(self, identity: bytes, error: zmq.ZMQError) -> None:
        """A message could not be sent to ``identity``."""
        if isinstance(error, zmq.Again):
            # Its queue is full: the peer does not read what it is sent.
            self._intake.unreachable(identity)
        elif error.errno == zmq.EHOSTUNREACH:
            self._core.trainer_unreachable(identity)
        else:
            raise error

    def drain(self, poller: zmq.Poller, wake_fd: int) -> None:
        """Reads, and drops, what peers send until their connections have closed or
        ``NOTICE_LINGER_MS`` has passed (Note [Closing with peers connected] in daemon.py)."""
        deadline = time.monotonic() + NOTICE_LINGER_MS / 1000
        while self._intake.open_connections and (left := deadline - time.monotonic()) > 0:
            if wake_fd in dict(poller.poll(timeout=int(left * 1000) + 1)):
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(wake_fd)
            while time.monotonic() < deadline and self._socket.receive() is not None:
                pass  # the daemon serves nothing more
            with contextlib.suppress(zmq.Again):
                while event := parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK)):
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        self._intake.closed(int(event["value"]))
