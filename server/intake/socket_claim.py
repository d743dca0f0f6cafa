"""A daemon's claim on its socket's path: the lock file, the socket file and the GPU UUID link.

One daemon serves a socket path. It holds an exclusive lock on ``<socket>.lock`` for as long as
it runs, so a second daemon started on the same path refuses to start, and a socket file found
while the lock is held was left by a daemon that died. Taking the lock also removes the shared
memory that dead daemons of this user left behind. A GPU daemon links ``<GPU UUID>.sock`` to its
socket. A daemon that stops removes all of it, the lock file while it still holds the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

from dalid.protocol import endpoint, process_running, slabs, uuid_socket_path
from dalid.protocol.ownership import check_private_directory

log = logging.getLogger("dalid.server")


class AlreadyRunning(RuntimeError):
    """Another live daemon holds the socket."""


class SocketClaim:
    """The lock on ``socket``'s path and the GPU UUID link to it; :meth:`close` (idempotent)
    removes what it made."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self._lock_fd: int | None = None
        self._uuid_link: Path | None = None

    def acquire(self) -> None:
        """Takes the socket's lock file; a live daemon holding it means we must not start."""
        path = self.socket
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Another user who could enter it could connect; one who could write there could plant
        # links or take the socket's name. The runtime directory's rule: mode 0700.
        check_private_directory(path.parent, "socket directory")
        lock_path = path.with_name(path.name + ".lock")
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise AlreadyRunning(
                    f"a dalid daemon (pid {owner}) already serves {endpoint(path)}; stop it with "
                    f"`dalid stop --socket {path}` or choose another --socket"
                ) from None
            # A daemon that stops removes the lock file while it holds the lock (close()): a
            # lock taken on a file no longer at the path locks nothing; open the new one.
            if _same_file(fd, lock_path):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        # We hold the lock, so a socket file here was left by a daemon that died.
        if path.exists() or path.is_symlink():
            log.info("removing stale socket %s", path)
            path.unlink()
        _remove_stale_segments()

    def link_by_uuid(self, device_uuid: str) -> None:
        """``<socket dir>/<GPU UUID>.sock``, a link to the socket: a trainer finds the daemon
        of the GPU it was given by the GPU's UUID, whatever ordinal it has there."""
        link = uuid_socket_path(self.socket.parent, device_uuid)
        try:
            if link.is_symlink():
                link.unlink()  # a daemon of this GPU that died; we serve it now
            link.symlink_to(self.socket.name)
        except OSError as error:
            log.warning("cannot link %s to the socket: %s", link, error)
            return
        self._uuid_link = link

    def abandon(self) -> None:
        """Removes the socket file, its lock file and the GPU UUID link while the lock is held,
        for a process about to exit without :meth:`close`; from any thread."""
        if self._lock_fd is not None:
            if self._uuid_link is not None:
                with contextlib.suppress(OSError):
                    if os.readlink(self._uuid_link) == self.socket.name:
                        self._uuid_link.unlink()
            self.socket.unlink(missing_ok=True)
            lock_path = self.socket.with_name(self.socket.name + ".lock")
            if _same_file(self._lock_fd, lock_path):
                lock_path.unlink(missing_ok=True)

    def close(self) -> None:
        """Removes the GPU UUID link, the socket file and the lock file, and lets the lock go.
        Idempotent."""
        if self._uuid_link is not None:
            with contextlib.suppress(OSError):
                if os.readlink(self._uuid_link) == self.socket.name:
                    self._uuid_link.unlink()
            self._uuid_link = None
        if self._lock_fd is not None:
            self.socket.unlink(missing_ok=True)
            # Removed while still held, so that a clean stop leaves nothing in the runtime
            # directory; a daemon starting meanwhile sees the file gone (acquire).
            lock_path = self.socket.with_name(self.socket.name + ".lock")
            if _same_file(self._lock_fd, lock_path):
                lock_path.unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` names the file open as ``fd``."""
    try:
        named = path.stat()
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _remove_stale_segments() -> None:
    """Unlinks shared-memory slabs left by daemons of this user that died without cleaning up."""
    for path, record in slabs.user_segments():
        if process_running(record.pid):
            continue
        path.unlink(missing_ok=True)
        log.info("removed stale shared memory %s (%s)", path.name, record.label)
