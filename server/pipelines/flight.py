"""Which graph each pipeline is running, in a file that outlives the daemon: crash attribution.

A graph of allowed operators can still crash DALI (a bug in an operator, an input it was not
written for), and with it the daemon; the supervisor restarts it, and the client may register
the same graph again, and again. So every pipeline marks its slot of a file beside the socket
(``<socket>.inflight``, in the user's runtime directory) while DALI holds a run of it: the
graph's key, the trainer pids of the jobs that registered it, and its name. The writes are to a
shared mapping of the file, stores without a system call, and the kernel keeps them when the
process dies. A daemon that stops cleanly removes the file.

The next daemon on the socket reads what its predecessor left marked: those runs were in
flight when it died, and it judges each (graph, trainer) of them (Note [Convicting a graph]),
keeping what it decided in ``<socket>.suspects`` for as long as the trainers live, so that a
crash of its own does not lose it.

Note [Convicting a graph]
~~~~~~~~~~~~~~~~~~~~~~~~~
A crash is a run's only where no other trainer's run was in DALI with it: the runs in flight
were one trainer's, or one was a solo run (``runs/run_gate.py``). Those graphs are refused to
those trainers (``Standing.REFUSED``), naming why. Where several trainers' runs were in flight,
none is blamed outright: each (graph, trainer) is on probation (``Standing.PROBATION``), served
on a pipeline of its own whose next :data:`PROBATION_RUNS` runs go into DALI alone, so that a
crash then convicts it, and clean runs clear it. A refusal is never lifted while its trainer
lives. Why, and what it leaves open: docs/design/crash-attribution.md.

Only a death the daemon brought on itself counts: a fatal signal of its own (a segfault, a bus
error, an abort: Python's ``faulthandler`` writes it to ``<socket>.fault``, which stays empty
otherwise) or the kernel's OOM killer (the daemon's cgroup counted an ``oom_kill`` since the
daemon started). A daemon killed by an operator, a test or a node drain ran nothing that a
trainer should answer for: its jobs reconnect to the next daemon with their pipelines as ever.
"""

from __future__ import annotations

import contextlib
import enum
import faulthandler
import hashlib
import json
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dalid.protocol import process_running

log = logging.getLogger("dalid.server")

SLOTS = 256
# A slot: the graph key's first 16 bytes, 8 trainer pids, 16 bytes of the pipeline's name,
# whether its run is solo. That of a daemon before solo runs: the same without the flag.
_SLOT = struct.Struct("16s8i16s?3x")
_OLD_SLOT = struct.Struct("16s8i16s")
# Runs a graph on probation runs alone before it is cleared: a graph whose runs crash DALI
# (an operator's bug, hostile sizes) does so within its first runs; each costs other jobs
# the time DALI holds it alone (docs/design/crash-attribution.md).
PROBATION_RUNS = 16


class Standing(enum.Enum):
    """What the daemon does with a graph that was in flight for a trainer when a daemon died."""

    PROBATION = "probation"  # served, its runs alone in DALI, until PROBATION_RUNS pass
    REFUSED = "refused"  # refused to that trainer


@dataclass(frozen=True)
class Suspect:
    """A graph that was running for ``pid`` when a daemon died at ``when`` (epoch seconds)."""

    key: str
    pid: int
    name: str
    when: float
    standing: Standing = Standing.REFUSED


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
        self._lock = threading.Lock()  # the suspects: probation ends in executors' threads
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

    def cleared(self, key: bytes, pid: int) -> None:
        """Graph ``key`` ran its runs on probation for ``pid`` and the daemon lives: no longer
        a suspect."""
        with self._lock:
            suspect = self.suspects.get((key.hex(), pid))
            if suspect is None or suspect.standing is not Standing.PROBATION:
                return
            del self.suspects[(key.hex(), pid)]
            self._save()
        log.info(
            "pipeline %r ran %d runs alone for trainer pid %d, the daemon alive: its probation "
            "ends",
            suspect.name,
            PROBATION_RUNS,
            pid,
        )

    def running(
        self, instance_id: int, key: bytes, pids: Iterable[int], name: str, *, solo: bool = False
    ) -> None:
        """Pipeline ``instance_id`` hands DALI a run of graph ``key`` for these trainers;
        ``solo``: alone in DALI (probation)."""
        if self._map is None:
            return
        listed = [*sorted(set(pids))[:8]]
        listed += [0] * (8 - len(listed))
        slot = _SLOT.pack(key, *listed, name.encode()[:16], solo)
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
        if cause is None:
            if any(data):
                log.info(
                    "the previous daemon was killed with runs in flight, not by a fault of its "
                    "own: their graphs are served as before"
                )
            return []
        found = convicted(read_slots(data), info.st_mtime)
        for suspect in found:
            log.warning(
                "the previous daemon died (%s) while pipeline %r ran for trainer pid %d: %s",
                cause,
                suspect.name,
                suspect.pid,
                "that graph is refused to that trainer"
                if suspect.standing is Standing.REFUSED
                else "runs of other trainers were in flight too, so that graph is on probation "
                f"for that trainer (its next {PROBATION_RUNS} runs alone in DALI)",
            )
        return found

    def _load(self, new: list[Suspect]) -> dict[tuple[str, int], Suspect]:
        """The suspects of earlier crashes whose trainers live, with ``new``; written back."""
        known: list[Suspect] = []
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            fd = os.open(self._suspects_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd) as file:
                known = [
                    Suspect(**{**entry, "standing": Standing(entry.get("standing", "refused"))})
                    for entry in json.load(file)
                ]
        kept: dict[tuple[str, int], Suspect] = {}
        for suspect in [*known, *new]:
            earlier = kept.get((suspect.key, suspect.pid))
            if process_running(suspect.pid) and (
                earlier is None or earlier.standing is Standing.PROBATION
            ):
                kept[(suspect.key, suspect.pid)] = suspect  # a refusal is never lifted
        self.suspects = kept
        self._save()
        return kept

    def _save(self) -> None:
        """Writes :attr:`suspects` to ``<socket>.suspects`` (none: removes it)."""
        if self.suspects:
            temporary = self._suspects_path.with_name(self._suspects_path.name + ".new")
            temporary.unlink(missing_ok=True)
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as file:
                json.dump(
                    [{**s.__dict__, "standing": s.standing.value} for s in self.suspects.values()],
                    file,
                )
            temporary.replace(self._suspects_path)
        else:
            self._suspects_path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Slot:
    """A pipeline's run in flight, as a dead daemon left it marked."""

    key: str
    pids: tuple[int, ...]
    name: str
    solo: bool


def read_slots(data: bytes) -> list[Slot]:
    """The marked slots of an ``<socket>.inflight`` file's bytes (a daemon's before solo runs:
    read as not solo)."""
    layout = _SLOT if len(data) == SLOTS * _SLOT.size else _OLD_SLOT
    found = []
    for offset in range(0, len(data) - layout.size + 1, layout.size):
        values = layout.unpack_from(data, offset)
        key, pids, name = values[0], values[1:9], values[9]
        solo = layout is _SLOT and bool(values[10])
        if any(key):
            found.append(
                Slot(key.hex(), tuple(p for p in pids if p > 0),
                     name.rstrip(b"\0").decode(errors="replace"), solo)
            )  # fmt: skip
    return found


def convicted(slots: list[Slot], when: float) -> list[Suspect]:
    """The suspects of a crash with ``slots`` in flight (Note [Convicting a graph]): refused
    where the crash is theirs (a solo run's, or the only trainer's), else on probation."""
    solo = [slot for slot in slots if slot.solo]
    trainers = {pid for slot in slots for pid in slot.pids}
    found = []
    for slot in slots:
        guilty = slot.solo if solo else len(trainers) == 1
        standing = Standing.REFUSED if guilty else Standing.PROBATION
        found += [Suspect(slot.key, pid, slot.name, when, standing) for pid in slot.pids]
    return found


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
