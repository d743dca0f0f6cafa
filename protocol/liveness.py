"""Whether a peer's process lives: the pid namespace a pid means something in, and the check.

Both sides watch the other's pid where they share a pid namespace (``Hello.pid_namespace``,
``Welcome.pid_namespace``): the daemon its trainers', a client its daemon's.

The daemon asks about every peer once a second, so the check is three system calls: a pidfd
of the process (Linux 5.3 and later), polled without waiting (it reads as ready once the
process has exited, a zombie included), then closed. Where pidfds are refused (an older
kernel, a container's seccomp profile) it falls back to ``kill(pid, 0)`` and the process's
state in ``/proc``, some ten times the cost, mostly the kernel's making of that file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select


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
