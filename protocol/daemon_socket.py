"""Before a client says anything to a daemon: the socket is the user's, and so is its listener.

ZeroMQ connects to whatever a path names when it connects, and a client's first message can
carry a job token (a worker's hello, or the earlier jobs a trainer names after a restart) that
lets its holder into the job. So a client connects only to a socket that

- is a socket file of this user's, in a directory of this user's that no other user can write
  to, on a path no other user can change (:mod:`.ownership`). The one link followed is a GPU
  daemon's ``<GPU UUID>.sock``: the daemon's own link, beside its socket, to the socket's bare
  name; :func:`socket_target` gives the socket it names;
- is listened on by a process of this user's: a plain Unix connection to it, made just before
  ZeroMQ connects, reads the listener's credentials from the kernel (``SO_PEERCRED``), which
  no process can forge. Nothing is sent on that connection.

:func:`verified_socket` does both. A refusal is an :class:`~.ownership.UnsafePath` naming what
was wrong; a socket with no listener is a ``FileNotFoundError`` or ``ConnectionRefusedError``.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from .ownership import UnsafePath, check_owned_directory

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Credentials:
    """A process as the kernel reports it on a Unix socket (in this process's namespaces)."""

    pid: int
    uid: int
    gid: int


def listener_credentials(path: Path, timeout: float = 5.0) -> Credentials:
    """The credentials of the process listening on the Unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        probe.settimeout(timeout)
        probe.connect(os.fspath(path))
        raw = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    finally:
        probe.close()
    return Credentials(*_UCRED.unpack(raw))


def socket_target(path: Path) -> Path:
    """The socket file behind ``path``: ``path`` itself, or the socket a daemon's UUID link
    names. Raises UnsafePath unless it is the user's own socket in a directory of theirs."""
    me = os.getuid()
    info = os.lstat(path)
    target = path
    if stat.S_ISLNK(info.st_mode):
        name = os.readlink(path)
        if info.st_uid != me or "/" in name or name in ("", ".", ".."):
            raise UnsafePath(
                f"{path} is a link to {name} owned by uid {info.st_uid}: dalid follows only "
                "a GPU daemon's own link to the socket beside it; remove the link"
            )
        target = path.parent / name
        info = os.lstat(target)
    if not stat.S_ISSOCK(info.st_mode):
        raise UnsafePath(f"{target} is not a socket: remove it, or name the daemon's socket")
    if info.st_uid != me:
        raise UnsafePath(
            f"the socket {target} belongs to uid {info.st_uid}, not you (uid {me}): it is not "
            "your daemon's; refusing to connect"
        )
    check_owned_directory(target.parent, "socket directory")
    return target


def verified_socket(path: Path, timeout: float = 5.0) -> Path:
    """:func:`socket_target`, once its listener is known to run as this user."""
    target = socket_target(path)
    listener = listener_credentials(target, timeout)
    if listener.uid != os.getuid():
        raise UnsafePath(
            f"the process listening on {target} (pid {listener.pid}) runs as uid "
            f"{listener.uid}, not as you (uid {os.getuid()}): it is not your daemon; "
            "refusing to send it anything"
        )
    return target
