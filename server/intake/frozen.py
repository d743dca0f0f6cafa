"""Trainers whose process is stopped or frozen: the daemon drops their connection.

A stopped process (SIGSTOP, SIGTSTP, a debugger's stop) or one frozen by its cgroup (a paused
container) is alive to the kernel and keeps its socket open, so no closed connection tells the
daemon. Each reap the daemon looks at the state of every trainer's process instead, in
``/proc/PID/stat`` and its cgroup's freezer; one seen stopped or frozen at every look for
``FROZEN_LIMIT_S`` has its connection shut down, which ends its job as a closed connection
does, and its link tells the trainer why once it runs again. The daemon sends no ZeroMQ
heartbeats for this: Note [No heartbeats from the daemon] in daemon.py.

A trainer the daemon cannot see (pid 0: another pid namespace) is not looked at: its job lives
until its connection closes, or is reclaimed when its places are wanted.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# How long a trainer's process may stay stopped or frozen before the daemon drops it.
FROZEN_LIMIT_S = 3.0


class ProcessState(enum.Enum):
    RUNNING = "running"  # anything else: running, sleeping, waiting on a disk
    STOPPED = "stopped"  # by a signal or a debugger (state T or t)
    FROZEN = "frozen"  # by its cgroup's freezer
    GONE = "gone"


@dataclass(frozen=True)
class Freezers:
    """Where this daemon sees the cgroup hierarchies that can freeze a process: the cgroup v1
    freezer's mount point and the cgroup v2 mount point (None: not mounted here)."""

    v1: Path | None
    v2: Path | None

    @classmethod
    def mounted(cls, mountinfo: Path = Path("/proc/self/mountinfo")) -> Freezers:
        v1 = v2 = None
        try:
            lines = mountinfo.read_text().splitlines()
        except OSError:
            return cls(None, None)
        for line in lines:
            fields, _, tail = line.partition(" - ")
            parts, kind = fields.split(), tail.split()
            # A mount of a cgroup's subtree (its root not "/") is not one paths map onto.
            if len(parts) < 5 or len(kind) < 3 or parts[3] != "/":
                continue
            if kind[0] == "cgroup" and "freezer" in kind[2].split(",") and v1 is None:
                v1 = Path(parts[4])
            elif kind[0] == "cgroup2" and v2 is None:
                v2 = Path(parts[4])
        return cls(v1, v2)

    def state_file(self, cgroups: str) -> Path | None:
        """The file that says whether the cgroup of a process is frozen, from the process's
        ``/proc/PID/cgroup``; None: it has none (the root cgroup, which cannot be frozen, or
        no freezer mounted here)."""
        for line in cgroups.splitlines():
            hierarchy, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if self.v1 is not None and "freezer" in controllers.split(","):
                candidate = self.v1 / path.lstrip("/") / "freezer.state"
            elif self.v2 is not None and hierarchy == "0" and controllers == "":
                candidate = self.v2 / path.lstrip("/") / "cgroup.events"
            else:
                continue
            if candidate.is_file():
                return candidate
        return None


def is_frozen(state_file: Path) -> bool:
    """Whether the cgroup whose freezer state ``state_file`` holds is frozen."""
    try:
        text = state_file.read_text()
    except OSError:
        return False
    if state_file.name == "freezer.state":
        return text.strip() == "FROZEN"
    return "frozen 1" in text.splitlines()


def read_proc(pid: int, name: str) -> bytes | None:
    """``/proc/PID/NAME`` (None: no such process); read raw, as the loop does it each second
    for each trainer."""
    try:
        fd = os.open(f"/proc/{pid}/{name}", os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return None
    finally:
        os.close(fd)


def scheduler_state(pid: int) -> str | None:
    """The state letter of ``pid`` in ``/proc/PID/stat`` (None: no such process)."""
    stat = read_proc(pid, "stat")
    if stat is None:
        return None
    # The command name, in parentheses, may hold anything: the state follows its last ")".
    after = stat[stat.rfind(b")") + 2 :]
    return after[:1].decode("ascii", "replace") or None


class FrozenTrainers:
    """Since when each trainer's process has been seen stopped or frozen; used by the loop's
    thread alone. A process's cgroup is read at each look (a process may be moved), its
    freezer's state file found again only when that changed."""

    def __init__(self, freezers: Freezers | None = None, limit_s: float = FROZEN_LIMIT_S) -> None:
        self._freezers = Freezers.mounted() if freezers is None else freezers
        self._limit_s = limit_s
        self._since: dict[bytes, float] = {}
        self._dropped: set[bytes] = set()
        # Each pid's cgroups as last read, and the freezer's state file they name.
        self._state_files: dict[int, tuple[bytes, Path | None]] = {}

    def state(self, pid: int) -> ProcessState:
        letter = scheduler_state(pid)
        if letter is None or letter in "ZX":
            return ProcessState.GONE
        if letter in "Tt":
            return ProcessState.STOPPED
        state_file = self._state_file(pid)
        if state_file is not None and is_frozen(state_file):
            return ProcessState.FROZEN
        return ProcessState.RUNNING

    def _state_file(self, pid: int) -> Path | None:
        if self._freezers.v1 is None and self._freezers.v2 is None:
            return None  # no freezer mounted here: nothing to read each second
        cgroups = read_proc(pid, "cgroup")
        if cgroups is None:
            return None
        known = self._state_files.get(pid)
        if known is None or known[0] != cgroups:
            known = (cgroups, self._freezers.state_file(cgroups.decode(errors="replace")))
            self._state_files[pid] = known
        return known[1]

    def past_limit(
        self, now: float, trainers: Iterable[tuple[bytes, int]]
    ) -> list[tuple[bytes, int, ProcessState, float]]:
        """Of ``trainers`` (connection, pid), those stopped or frozen at every look for the
        limit and not yet reported: (connection, pid, state, seconds held)."""
        since: dict[bytes, float] = {}
        pids: set[int] = set()
        found: list[tuple[bytes, int, ProcessState, float]] = []
        for identity, pid in trainers:
            if pid <= 0:
                continue
            pids.add(pid)
            state = self.state(pid)
            if state not in (ProcessState.STOPPED, ProcessState.FROZEN):
                continue
            since[identity] = first = self._since.get(identity, now)
            if now - first >= self._limit_s and identity not in self._dropped:
                found.append((identity, pid, state, now - first))
        self._since = since
        self._dropped = {identity for identity in self._dropped if identity in since}
        self._dropped.update(identity for identity, *_ in found)
        self._state_files = {pid: known for pid, known in self._state_files.items() if pid in pids}
        return found
