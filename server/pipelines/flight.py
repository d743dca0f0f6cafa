"""Which graph each pipeline is running, in a file that outlives the daemon: crash attribution.

A graph of allowed operators can still crash DALI (a bug in an operator, an input it was not
written for), and with it the daemon; the supervisor restarts it, and the client may register
the same graph again, and again. So every pipeline marks its slot of a file beside the socket
(``<socket>.inflight``, in the user's runtime directory) while DALI holds a run of it: the
graph's key, the trainer pids of the jobs that registered it, and its name. The writes are to a
shared mapping of the file, stores without a system call, and the kernel keeps them when the
process dies. A daemon that stops cleanly removes the file.

The next daemon on the socket reads what its predecessor left marked: those runs were in
flight when it died. It refuses each of those graphs to those trainers (``suspected``), naming
why, and keeps the list in ``<socket>.suspects`` for as long as the trainers live, so that a
crash of its own does not lose it.

Only a death the daemon brought on itself counts: a fatal signal of its own (a segfault, a bus
error, an abort: Python's ``faulthandler`` writes it to ``<socket>.fault``, which stays empty
otherwise) or the kernel's OOM killer (the daemon's cgroup counted an ``oom_kill`` since the
daemon started). A daemon killed by an operator, a test or a node drain ran nothing that a
trainer should answer for: its jobs reconnect to the next daemon with their pipelines as ever.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import logging
import mmap
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dalid.protocol import process_running

log = logging.getLogger("dalid.server")

SLOTS = 256
# A slot: the graph key's first 16 bytes, 8 trainer pids, 16 bytes of the pipeline's name.
_SLOT = struct.Struct("16s8i16s")


@dataclass(frozen=True)
class Suspect:
    """A graph that was running for ``pid`` when a daemon died at ``when`` (epoch seconds)."""

    key: str
    pid: int
    name: str
    when: float


def graph_key(*parts: bytes | str) -> bytes:
    """The 16 bytes that name a graph in the recorder."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.digest()[:16]


class FlightRecorder:
    """The daemon's slots in ``<socket>.inflight``; what the previous daemon left is read
    first (:attr:`suspects`). ``close()`` removes the file: a clean stop leaves no suspect."""

    def __init__(self, socket: Path) -> None:
        self.path = socket.with_name(socket.name + ".inflight")
        self._suspects_path = socket.with_name(socket.name + ".suspects")
        self._fault_path = socket.with_name(socket.name + ".fault")
        self._oom_path = socket.with_name(socket.name + ".oom")
        cause = self._how_predecessor_died()
        self.suspects = self._load(self._left_by_predecessor(cause))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, 0)
            os.ftruncate(fd, SLOTS * _SLOT.size)
            self._map: mmap.mmap | None = mmap.mmap(fd, SLOTS * _SLOT.size)
        finally:
            os.close(fd)
        _write_private(self._oom_path, str(oom_kills()))
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        # The file stays open for the daemon's life: faulthandler writes to its descriptor from
        # the signal handler, which can open nothing.
        self._fault = os.fdopen(os.open(self._fault_path, flags, 0o600), "w")
        faulthandler.enable(self._fault, all_threads=True)

    def suspected(self, key: bytes, pid: int) -> Suspect | None:
        return self.suspects.get((key.hex(), pid))

    def running(self, instance_id: int, key: bytes, pids: Iterable[int], name: str) -> None:
        """Pipeline ``instance_id`` hands DALI a run of graph ``key`` for these trainers."""
        if self._map is None:
            return
        listed = [*sorted(set(pids))[:8]]
        listed += [0] * (8 - len(listed))
        slot = _SLOT.pack(key, *listed, name.encode()[:16])
        offset = (instance_id % SLOTS) * _SLOT.size
        self._map[offset : offset + _SLOT.size] = slot

    def idle(self, instance_id: int) -> None:
        """Pipeline ``instance_id`` has no run in DALI."""
        if self._map is None:
            return
        offset = (instance_id % SLOTS) * _SLOT.size
        self._map[offset : offset + _SLOT.size] = bytes(_SLOT.size)

    def close(self) -> None:
        """A clean stop: nothing was in flight. Idempotent."""
        if self._map is None:
            return
        faulthandler.disable()
        self._fault.close()
        self._map.close()
        self._map = None
        for path in (self.path, self._fault_path, self._oom_path):
            path.unlink(missing_ok=True)

    def _how_predecessor_died(self) -> str | None:
        """Why the previous daemon died, where it brought that on itself; None for a clean
        stop, a first start or a kill from outside."""
        with contextlib.suppress(OSError):
            fault = self._fault_path.read_text(errors="replace").strip()
            if fault:
                log.warning("the previous daemon died of a fatal signal:\n%s", fault)
                return fault.splitlines()[0]
        with contextlib.suppress(OSError, ValueError):
            if oom_kills() > int(self._oom_path.read_text()):
                return "the kernel's OOM killer ended a process of the daemon's cgroup"
        return None

    def _left_by_predecessor(self, cause: str | None) -> list[Suspect]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return []  # none, or a clean stop
        try:
            info = os.fstat(fd)
            data = os.read(fd, SLOTS * _SLOT.size)
        finally:
            os.close(fd)
        found: list[Suspect] = []
        if cause is None:
            if any(data):
                log.info(
                    "the previous daemon was killed with runs in flight, not by a fault of its "
                    "own: their graphs are served as before"
                )
            return found
        for offset in range(0, len(data) - _SLOT.size + 1, _SLOT.size):
            key, *pids, name = _SLOT.unpack_from(data, offset)
            if any(key):
                found += [
                    Suspect(key.hex(), pid, name.rstrip(b"\0").decode(errors="replace"),
                            info.st_mtime)
                    for pid in pids
                    if pid > 0
                ]  # fmt: skip
        for suspect in found:
            log.warning(
                "the previous daemon died (%s) while pipeline %r ran for trainer pid %d: that "
                "graph is refused to that trainer",
                cause,
                suspect.name,
                suspect.pid,
            )
        return found

    def _load(self, new: list[Suspect]) -> dict[tuple[str, int], Suspect]:
        """The suspects of earlier crashes whose trainers live, with ``new``; written back."""
        known: list[Suspect] = []
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            fd = os.open(self._suspects_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd) as file:
                known = [Suspect(**entry) for entry in json.load(file)]
        kept = {(s.key, s.pid): s for s in [*known, *new] if process_running(s.pid)}
        if kept:
            temporary = self._suspects_path.with_name(self._suspects_path.name + ".new")
            temporary.unlink(missing_ok=True)
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as file:
                json.dump([s.__dict__ for s in kept.values()], file)
            temporary.replace(self._suspects_path)
        else:
            self._suspects_path.unlink(missing_ok=True)
        return kept


def oom_kills() -> int:
    """How many processes the kernel's OOM killer has ended in this process's memory cgroup
    (v2's ``memory.events``, else v1's ``memory.oom_control``), 0 where neither can be read."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                counters = Path("/sys/fs/cgroup", path.lstrip("/"), "memory.events")
            elif "memory" in controllers.split(","):
                counters = Path("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.oom_control")
            else:
                continue
            with contextlib.suppress(OSError, ValueError):
                for entry in counters.read_text().splitlines():
                    name, _, value = entry.partition(" ")
                    if name == "oom_kill":
                        return int(value)
    return 0


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)


def refusal(suspect: Suspect) -> str:
    """Why a suspected graph is refused to its trainer."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(suspect.when))
    return (
        f"this pipeline ({suspect.name or 'unnamed'}) was running for this trainer (pid "
        f"{suspect.pid}) when the daemon died at {when}: it is refused to this trainer, so that "
        "one graph cannot crash the daemon over and over; a new trainer process may register it"
    )
