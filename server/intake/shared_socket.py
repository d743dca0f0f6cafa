"""The daemon's ROUTER socket, shared by its I/O loop and its executors.

The loop receives every message and answers requests; an executor sends a batch's result
itself, rather than handing it to the loop (Note [Sending from an executor]). ZeroMQ lets one
thread at a time use a socket, with a full memory barrier between them: :class:`SharedSocket`
holds the socket, the lock that every use of it takes, and the outbox, where messages wait that
the loop is to send.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import zmq

from dalid.protocol import Message, encode, transport

_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)

# Note [Sending from an executor]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An executor sends a batch's result itself, under the socket's lock, and never waits for it:
# what it cannot send at once goes to the outbox, and so does all it sends until the loop has
# sent that, so one thread's messages keep their order. The loop takes the lock for each
# receive and send, never while it waits (on the socket's descriptor), and asks ZMQ_EVENTS
# before it sleeps; whoever else sends asks afterwards and wakes the loop. The lock guards the
# socket and the outbox only. Why and the tests: docs/design/executor-wakes.md.


class SharedSocket:
    """The daemon's socket and its outbox.

    ``wake()`` wakes the loop; ``deliverable(peer, message)`` says whether a message is still
    to be sent (a batch's result is not once its job has ended); ``undelivered(peer, error)``
    deals with a message that could not be sent, in the loop's thread.
    """

    def __init__(
        self,
        wake: Callable[[], None],
        deliverable: Callable[[bytes, Message], bool],
        undelivered: Callable[[bytes, zmq.ZMQError], None],
    ) -> None:
        self._wake = wake
        self._deliverable = deliverable
        self._undelivered = undelivered
        self._lock = threading.Lock()
        self._outbox: collections.deque[tuple[bytes, Message, int | None]] = collections.deque()
        self._socket: zmq.Socket[Any] | None = None
        self._monitored = False
        # Once the loop runs: its messages always go through the outbox or ``send``.
        self._loop_thread: int | None = None
        # The loop's last ``readable`` or ``receive`` found no message, and the loop has not used
        # the socket since (only a use takes in news without signalling the descriptor; the
        # executors wake the loop for what their sends take in).
        self._quiet = False

    def open(self, sock: zmq.Socket[Any]) -> None:
        """Takes ``sock``, which this object closes."""
        self._socket = sock

    def monitor(self, events: int) -> zmq.Socket[Any]:
        """A PAIR socket that reports ``events`` of the socket's connections (the caller's)."""
        assert self._socket is not None
        with self._lock:
            self._monitored = True
            return self._socket.get_monitor_socket(events)

    def loop_starts(self) -> int:
        """The calling thread is the loop's from now on; returns the descriptor to poll."""
        assert self._socket is not None
        self._loop_thread = threading.get_ident()
        with self._lock:
            return int(self._socket.getsockopt(zmq.FD))

    def close(self, linger_ms: int) -> None:
        """Closes the socket; a message sent later waits in the outbox, unsent. Idempotent."""
        with self._lock:
            if self._socket is None:
                return
            if self._monitored:
                self._socket.disable_monitor()
            self._socket.close(linger=linger_ms)
            self._socket = None

    # --- from any thread ------------------------------------------------------------------------

    def push(self, identity: bytes, message: Message, request_id: int | None = None) -> None:
        """Sends ``message`` to ``identity``, or leaves it for the loop to send."""
        if threading.get_ident() != self._loop_thread:
            frames = [identity, *encode(message, request_id)]
            # Never waits for the loop: while it holds the socket, it is awake and sends the
            # outbox before it sleeps.
            if self._lock.acquire(blocking=False):
                try:
                    if not self._outbox and self._send_now(identity, message, frames):
                        return
                    self._outbox.append((identity, message, request_id))
                finally:
                    self._lock.release()
            else:
                self._outbox.append((identity, message, request_id))
        else:
            self._outbox.append((identity, message, request_id))
        self._wake()

    def _send_now(self, identity: bytes, message: Message, frames: list[Any]) -> bool:
        """With the lock held: sends ``frames`` if the socket is open and the peer can take
        them. False: nothing was sent, and the loop is to send ``message``."""
        sock = self._socket
        if sock is None:
            return False
        if not self._deliverable(identity, message):
            return True  # dropped, as the loop would drop it
        try:
            transport.send_frames(sock, frames, _NOBLOCK)
        except zmq.ZMQError:
            return False
        if int(sock.getsockopt(zmq.EVENTS)) & _POLLIN:
            self._wake()  # the send may have taken in the news of a message for the loop
        return True

    # --- from the loop's thread -----------------------------------------------------------------

    def readable(self) -> bool:
        """Whether a message waits to be received."""
        with self._lock:
            waiting = self._socket is not None and bool(
                int(self._socket.getsockopt(zmq.EVENTS)) & _POLLIN
            )
        self._quiet = not waiting
        return waiting

    def may_wait(self) -> bool:
        """Whether a message may wait unsignalled: ``readable``, unless its last answer was no
        and the loop has not used the socket since (then the descriptor signals any news)."""
        return not self._quiet and self.readable()

    def receive(self) -> list[zmq.Frame] | None:
        """The next message's frames, without waiting; None if none waits, and then, as after a
        ``readable`` that said no, the descriptor signals the next one (a receive that finds
        nothing takes in the socket's news as that look does: one call a message, where a look
        before each receive made two)."""
        assert self._socket is not None
        with self._lock:
            try:
                frames = transport.recv_frames(self._socket, _NOBLOCK)
            except zmq.Again:
                self._quiet = True
                return None
        self._quiet = False
        return frames

    def send(self, identity: bytes, message: Message, request_id: int | None) -> None:
        """Sends ``message`` now, or hands it to ``undelivered``."""
        with self._lock:
            failure = self._send_locked(identity, message, request_id)
        self._quiet = False
        if failure is not None:
            self._undelivered(identity, failure)

    def flush(self) -> None:
        """Sends what waits in the outbox."""
        while self._outbox:
            failure = None
            # Each message leaves the outbox and is sent under the lock: a message pushed
            # later finds the outbox empty only once those before it have left.
            with self._lock:
                identity, message, request_id = self._outbox.popleft()
                if self._deliverable(identity, message):
                    failure = self._send_locked(identity, message, request_id)
                    self._quiet = False
            if failure is not None:
                self._undelivered(identity, failure)

    def _send_locked(
        self, identity: bytes, message: Message, request_id: int | None
    ) -> zmq.ZMQError | None:
        assert self._socket is not None
        try:
            transport.send_to(self._socket, identity, message, request_id, block=False)
        except zmq.ZMQError as error:
            return error
        return None
