"""Who is at the other end of a connection: the credentials the kernel gives for its socket.

When a process connects a Unix socket the kernel records its pid, uid and gid, and the
listening side reads them with ``SO_PEERCRED``. A client cannot choose them, unlike what it
writes in its ``hello``: the daemon decides on them whom it serves and whose death ends a job.
The pid is given in the daemon's pid namespace, and is 0 where the client's process cannot be
seen from there (another, unrelated pid namespace).

ZeroMQ reads the same credentials when it accepts a connection and attaches them to every
message of it, in the message's ``Peer-Address`` property (``<address>:<uid>:<gid>:<pid>``; a
peer cannot set that property, ZeroMQ's own comes first): :func:`from_message` reads them, and
they name the sender of that very message even when its process has closed the connection and
the descriptor is gone, or reused, by the time the daemon reads it.

ZeroMQ owns the connections' descriptors. The daemon learns a connection's number from a
message (``zmq.SRCFD``) or a socket-monitor event, and works on a duplicate of it: a duplicate
names the same socket even if ZeroMQ closes the number meanwhile and a new connection reuses
it, so the socket whose inode the daemon checked is the one it reads or shuts down.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class PeerCredentials:
    """The process that connected: ``pid`` in the daemon's pid namespace (0: not visible)."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class SocketId:
    """One socket, by device and inode: a descriptor number may name another one later."""

    device: int
    inode: int


def from_message(frame: Any) -> PeerCredentials | None:
    """The credentials ZeroMQ attached to the message of ``frame`` (a ``zmq.Frame``), or None
    where it attached none (not a Unix socket) or they cannot be read."""
    try:
        address = frame.get("Peer-Address")
    except Exception:
        return None
    if not isinstance(address, str):
        return None
    # Every message carries them: a connection's are parsed once (the same text always
    # names the same credentials), not at each of its messages.
    known = _PARSED.get(address)
    if known is None:
        if len(_PARSED) >= _PARSED_AT_MOST:
            _PARSED.clear()
        known = _PARSED[address] = parse_peer_address(address) or _UNPARSED
    return None if known is _UNPARSED else known


_UNPARSED = PeerCredentials(-1, -1, -1)
# Peer-Address texts parsed lately (one per connection), and the most remembered at once.
_PARSED: dict[str, PeerCredentials] = {}
_PARSED_AT_MOST = 4096


def parse_peer_address(address: str) -> PeerCredentials | None:
    """``<address>:<uid>:<gid>:<pid>`` as ZeroMQ writes it for a Unix socket, else None."""
    parts = address.rsplit(":", 3)
    if len(parts) != 4 or not all(part.isdigit() for part in parts[1:]):
        return None
    uid, gid, pid = (int(part) for part in parts[1:])
    return PeerCredentials(pid, uid, gid)


def not_served(uids: frozenset[int], uid: int) -> str:
    """Why a process of ``uid`` is refused by a daemon that serves ``uids``: said alike by the
    handshake's gate and by the intake."""
    served = " and ".join(str(each) for each in sorted(uids, reverse=True))
    return (
        f"this daemon serves the processes of uid {served} only (its socket is theirs); "
        f"uid {uid} is refused"
    )


def read_peer(fd: int) -> tuple[SocketId, PeerCredentials] | None:
    """The socket behind descriptor ``fd`` and its peer's credentials; None if ``fd`` is no
    longer an open Unix socket."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return None
    with _as_socket(duplicate) as sock:
        if sock is None:
            return None
        info = os.fstat(sock.fileno())
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        except OSError:
            return None
        pid, uid, gid = _UCRED.unpack(raw)
        return SocketId(info.st_dev, info.st_ino), PeerCredentials(pid, uid, gid)


def shut_down(fd: int, expected: SocketId) -> bool:
    """Shuts the connection on ``fd`` down both ways, if ``fd`` still names socket ``expected``.

    ZeroMQ then finds the connection closed, as if the peer had gone, and frees it (its socket
    monitor reports the disconnection). Whether it was shut down here.
    """
    try:
        duplicate = os.dup(fd)
    except OSError:
        return False
    with _as_socket(duplicate) as sock:
        if sock is None:
            return False
        info = os.fstat(sock.fileno())
        if SocketId(info.st_dev, info.st_ino) != expected:
            return False  # the number was reused: not the connection we meant
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False  # already disconnected
        return True


@contextlib.contextmanager
def _as_socket(duplicate: int) -> Iterator[socket.socket | None]:
    """A socket object owning ``duplicate`` (closed on exit), or None if it is no socket."""
    try:
        if not stat.S_ISSOCK(os.fstat(duplicate).st_mode):
            os.close(duplicate)
            yield None
            return
        sock = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        yield None
        return
    try:
        yield sock
    finally:
        sock.close()
