"""Whether a peer's process lives: the pid namespace a pid means something in, and the check.

Both sides watch the other's pid where they share a pid namespace (``Hello.pid_namespace``,
``Welcome.pid_namespace``): the daemon its trainers', a client its daemon's.
"""

from __future__ import annotations

import os
from pathlib import Path


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not tell)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_running(pid: int) -> bool:
    """Whether ``pid`` names a live process in this pid namespace (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    # The state follows the parenthesised command name, which may itself hold spaces.
    return stat.rpartition(")")[2].split()[:1] != ["Z"]
