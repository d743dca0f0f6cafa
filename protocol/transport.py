"""ZeroMQ sockets for dalid: one factory, and send/receive through the codec.

Roles: the daemon binds one ROUTER; every client connection is a DEALER. The factory sets the
options both sides rely on, so no socket is made elsewhere with other settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

from .codec import Envelope, decode, encode
from .messages import Message

# Linger briefly so a goodbye or release already queued still leaves on close.
LINGER_MS = 200
# Drop oversized frames at the transport, before they are allocated.
MAX_MESSAGE_BYTES = 1 << 31


def make_socket(
    context: zmq.Context[Any],
    kind: int,
    address: str,
    *,
    bind: bool,
    heartbeat_ms: tuple[int, int] | None = None,
    queue_limits: tuple[int, int] | None = None,
    max_frame_bytes: int = MAX_MESSAGE_BYTES,
    zap_domain: bytes = b"",
) -> zmq.Socket[Any]:
    """A socket of ``kind`` bound (daemon) or connected (client) to ``address``.

    ``heartbeat_ms`` (interval, timeout): ZeroMQ pings every peer at that interval and drops
    the connection of one that answers nothing within the timeout. Any peer answers on its own
    I/O thread, whatever its program is doing.

    ``queue_limits`` (send, receive): the most whole messages ZeroMQ queues per connection in
    each direction. Without them (0) nothing is ever dropped or refused, and a peer that sends
    faster than the socket's owner reads, or reads slower than it sends, grows its memory
    without bound: a server facing clients it does not control sets them (a client sends only
    what it means to and may queue its own backlog). ZeroMQ drops a connection that starts a
    frame of more than ``max_frame_bytes``, before it allocates it. ``zap_domain``: ZeroMQ asks
    the ZAP handler of the socket's context about every connection before attaching it.
    """
    sock: zmq.Socket[Any] = context.socket(kind)
    try:
        if heartbeat_ms is not None:
            sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms[0])
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_ms[1])
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        if zap_domain:
            sock.setsockopt(zmq.ZAP_DOMAIN, zap_domain)
            # No handler answering (it stopped): refuse, rather than let everyone in.
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        # Never drop messages silently when a peer is slow: block or poll instead. A ROUTER
        # over its send limit refuses the message (EAGAIN, see ROUTER_MANDATORY); over its
        # receive limit it stops reading that connection, and the sender queues or blocks.
        send_limit, receive_limit = queue_limits or (0, 0)
        sock.setsockopt(zmq.SNDHWM, send_limit)
        sock.setsockopt(zmq.RCVHWM, receive_limit)
        if kind == zmq.ROUTER:
            # A reply to a peer that has gone raises EHOSTUNREACH instead of vanishing, and one
            # to a peer whose queue is full raises EAGAIN (when sent without blocking).
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def send(sock: zmq.Socket[Any], message: Message, request_id: int | None = None) -> None:
    """Sends ``message`` on a DEALER socket; large buffer frames go without a copy."""
    send_frames(sock, encode(message, request_id))


def send_to(
    sock: zmq.Socket[Any],
    peer: bytes,
    message: Message,
    request_id: int | None = None,
    *,
    block: bool = True,
) -> None:
    """Sends ``message`` to ``peer`` on a ROUTER socket; without ``block``, a peer whose queue
    is full raises ``zmq.Again`` and nothing is sent."""
    send_frames(sock, [peer, *encode(message, request_id)], 0 if block else _NOBLOCK)


def recv(sock: zmq.Socket[Any]) -> Envelope:
    """Receives and decodes one message on a DEALER socket (raises ProtocolError)."""
    return decode(recv_frames(sock))


# Frames below this size are copied into their message, which costs less than handing
# ZeroMQ a buffer to keep until it is sent; larger ones go without a copy.
COPY_BELOW_BYTES = zmq.COPY_THRESHOLD
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)


def send_frames(sock: zmq.Socket[Any], frames: Sequence[Any], flags: int = 0) -> None:
    """Sends ``frames`` as one multipart message (what ``send_multipart`` does, for less)."""
    last = len(frames) - 1
    for index, frame in enumerate(frames):
        # Buffers (memoryviews, numpy samples of any shape) by their bytes; bytes by length.
        size = frame.nbytes if hasattr(frame, "nbytes") else len(frame)
        more = _SNDMORE if index < last else 0
        sock.send(frame, flags | more, copy=size < COPY_BELOW_BYTES)


def recv_frames(sock: zmq.Socket[Any], flags: int = 0) -> list[zmq.Frame]:
    """Receives one multipart message's frames without copying them (raises zmq.Again with
    ``zmq.NOBLOCK`` when none is waiting)."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames
