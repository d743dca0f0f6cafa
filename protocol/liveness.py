"""Whether a peer's process lives: the pid namespace a pid means something in, and the check.

Both sides watch the other's pid where they share a pid namespace (``Hello.pid_namespace``,
``Welcome.pid_namespace``): the daemon its trainers', a client its daemon's.

One check (:func:`process_running`) is three system calls: a pidfd of the process (Linux 5.3
and later), polled without waiting (it reads as ready once the process has exited, a zombie
included), then closed. Where pidfds are refused (an older kernel, a container's seccomp
profile) it falls back to ``kill(pid, 0)`` and the process's state in ``/proc``, some ten
times the cost, mostly the kernel's making of that file.

The daemon asks about every peer's process once a second, some seventy with eight jobs: a
:class:`ProcessWatch` holds each watched process's pidfd open while it is watched, so that
asking about all of them is one ``poll``, and a pidfd names its process even once its pid is
reused (a pid asked about anew might name another process by then).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import threading


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not tell)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


# Whether pidfd_open works here; set False at the first refusal other than "no such process".
_pidfds = hasattr(os, "pidfd_open")


def process_running(pid: int) -> bool:
    """Whether ``pid`` names a live process in this pid namespace (a zombie is not)."""
    global _pidfds
    if _pidfds and pid > 0:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError as error:
            # ENOSYS, or EPERM from a seccomp filter: no pidfds in this process, ever. Anything
            # else (a thread's id, which has no pidfd) is asked the old way, this time.
            if error.errno in (errno.ENOSYS, errno.EPERM):
                _pidfds = False
        else:
            try:
                poll = select.poll()
                poll.register(fd, select.POLLIN)
                return not poll.poll(0)
            finally:
                os.close(fd)
    return _running_by_proc(pid)


class ProcessWatch:
    """Processes watched for their exit, each through a pidfd this object owns from
    :meth:`watch` to the matching :meth:`unwatch` (counted: a process may be watched for
    several reasons at once) or :meth:`close`. Safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # pid -> [its pidfd (-1: none, asked the old way at each look), times watched].
        self._watched: dict[int, list[int]] = {}
        self._pids_by_fd: dict[int, int] = {}
        self._poll = select.poll()
        # Processes that had exited when first watched (no pidfd could be opened).
        self._gone: set[int] = set()

    def watch(self, pid: int) -> None:
        """Watches ``pid`` (a process of this pid namespace; 0 or less: none, ignored)."""
        if pid <= 0:
            return
        with self._lock:
            entry = self._watched.get(pid)
            if entry is not None:
                entry[1] += 1
                return
            fd = _open_pidfd(pid)
            if fd is None:
                self._gone.add(pid)
                fd = -1
            elif fd >= 0:
                self._poll.register(fd, select.POLLIN)
                self._pids_by_fd[fd] = pid
            self._watched[pid] = [fd, 1]

    def unwatch(self, pid: int) -> None:
        """Stops one watch of ``pid``; its pidfd is closed with the last one."""
        with self._lock:
            entry = self._watched.get(pid)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] <= 0:
                self._forget(pid, entry[0])

    def exited(self) -> set[int]:
        """The watched processes that have exited (zombies included): one ``poll`` for all of
        those with a pidfd; the others (no pidfds here) are asked the old way, one by one."""
        with self._lock:
            gone = set(self._gone)
            gone.update(self._pids_by_fd[fd] for fd, _ in self._poll.poll(0))
            unpolled = [pid for pid, (fd, _) in self._watched.items() if fd < 0]
        gone.update(pid for pid in unpolled if pid not in gone and not _running_by_proc(pid))
        return gone

    def __len__(self) -> int:
        return len(self._watched)

    def close(self) -> None:
        """Closes every pidfd; nothing is watched any more. Idempotent."""
        with self._lock:
            for pid, (fd, _) in list(self._watched.items()):
                self._forget(pid, fd)

    def _forget(self, pid: int, fd: int) -> None:
        del self._watched[pid]
        self._gone.discard(pid)
        if fd >= 0:
            self._poll.unregister(fd)
            del self._pids_by_fd[fd]
            os.close(fd)


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``; None if the process is gone, -1 where it has none (pidfds refused
    here, or ``pid`` a thread's id: asked the old way)."""
    global _pidfds
    if not _pidfds:
        return -1 if _running_by_proc(pid) else None
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except OSError as error:
        if error.errno in (errno.ENOSYS, errno.EPERM):
            _pidfds = False
        return -1 if _running_by_proc(pid) else None


def _running_by_proc(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        stat = os.read(fd, 4096)
    except OSError:
        return True
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    # The state follows the parenthesised command name, which may itself hold spaces.
    return stat.rpartition(b")")[2].split()[:1] != [b"Z"]
