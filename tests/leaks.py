"""What a test left behind: a snapshot of this process and its children before each test and
one after, and the difference between them, attributed to the test.

A snapshot reads ``/proc`` and ``/dev/shm`` once (no sleeps): the processes (with their parents),
dalid's shared-memory segments (with the process that made each, from its record), the socket
files in the directories the tests made, this process's Python threads, native threads and open
file descriptors. What a test made and left is a leak; what it found already there is not (a
module's shared daemon, the process's ZeroMQ context), nor is what something already there made
during the test (a shared daemon's restarts, its segments). Known process-wide state that is
made lazily, on first use, and lives as long as the process is listed in ``_LONG_LIVED_*``,
each with the reason it is not a leak.

Only when something looks leaked does :func:`leaks` spend time: it collects garbage (an object
whose finalizer closes a socket or reaps a child may only be unreachable) and waits a few
seconds for processes whose parent is gone (a job's DataLoader workers notice a killed job by
polling, every 5 s) before naming what is still there.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dalid.protocol import slabs

_ME = os.getpid()

# Processes that Python or a library starts once, on first use, and keeps until this process
# exits; matched on their command line.
_LONG_LIVED_PROCESSES = [
    # multiprocessing's resource tracker: started by the first SharedMemory or named semaphore
    # (a DataLoader with workers makes some), it unlinks what a crashed process left and exits
    # only when this process does.
    re.compile(r"from multiprocessing\.resource_tracker import main"),
    # multiprocessing's fork server, when a test asks for that start method: one per process,
    # kept for every later Process.
    re.compile(r"from multiprocessing\.forkserver import main"),
]

# Native threads (by the name the kernel shows, /proc/self/task/*/comm) of process-wide pools
# that libraries start on first use and keep until the process exits. Python threads are
# checked by their objects (threading.enumerate()) and never matched here.
_LONG_LIVED_THREADS = [
    # ZeroMQ's I/O and reaper threads of a context: the client's process context
    # (dalid.client.connection.process_context) lives as long as the process, by design. A test
    # that makes a context of its own and does not terminate it is still caught by the file
    # descriptors the context holds (an epoll and eventfd mailboxes), which are not exempt.
    re.compile(r"ZMQbg/.*"),
]

# File descriptors of process-wide state, by what they point to (readlink /proc/self/fd/N).
_LONG_LIVED_FDS: list[re.Pattern[str]] = []


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    # Start time in clock ticks since boot: with the pid, it tells a process from a later one
    # that reuses its pid.
    start: int
    state: str

    @property
    def key(self) -> tuple[int, int]:
        return self.pid, self.start


@dataclass(frozen=True)
class Snapshot:
    processes: dict[int, Process]
    segments: dict[str, int]  # dalid segment name -> pid of the process that made it
    sockets: frozenset[Path]
    threads: dict[int, threading.Thread]  # Python threads by ident
    tasks: dict[int, str]  # native threads of this process: tid -> name
    fds: dict[int, str]  # open file descriptors of this process -> what they point to


def take(directories: Iterable[Path]) -> Snapshot:
    """A snapshot; ``directories`` are those whose socket files count."""
    return Snapshot(
        processes=_processes(),
        segments={path.name: record.pid for path, record in slabs.user_segments()},
        sockets=frozenset(_socket_files(directories)),
        threads={thread.ident: thread for thread in threading.enumerate() if thread.ident},
        tasks=_tasks(),
        fds=_fds(),
    )


@dataclass
class Leaks:
    """What a test left: each kind as the lines that name it."""

    processes: list[Process] = field(default_factory=list)
    segments: dict[str, int] = field(default_factory=dict)  # name -> pid that made it
    sockets: list[Path] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)
    fds: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.processes or self.segments or self.sockets or self.threads or self.fds)

    def lines(self) -> list[str]:
        kinds = {
            "processes": [_describe(process) for process in self.processes],
            "/dev/shm segments": [f"{name} (made by pid {pid})" for name, pid in self.segments.items()],
            "socket files": [str(path) for path in self.sockets],
            "threads": self.threads,
            "file descriptors": self.fds,
        }
        return [f"{kind}: {', '.join(items)}" for kind, items in kinds.items() if items]

    def clean_up(self) -> None:
        """Kills the processes, reaps those that are this process's children, and removes the
        segments and socket files, so that the tests after this one start clean."""
        for process in self.processes:
            try:
                os.kill(process.pid, signal.SIGKILL)
                if process.ppid == _ME:
                    os.waitpid(process.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        for name in self.segments:
            (slabs.SHM_DIR / name).unlink(missing_ok=True)
        for path in self.sockets:
            path.unlink(missing_ok=True)


def leaks(
    before: Snapshot,
    directories: Iterable[Path],
    runtime_dir: Path,
    known_pids: set[int],
    grace_s: float = 10.0,
) -> Leaks:
    """What was made since ``before`` and is still there (false if nothing).

    ``runtime_dir`` is the tests' $DALID_RUNTIME_DIR: a process whose parents are gone is ours
    if it has it in its environment. ``known_pids`` are processes the tests started (so a
    dead one's segments are ours, and never another test session's on the same machine).
    """
    directories = list(directories)
    found = _compare(before, take(directories), runtime_dir, known_pids)
    # Something looks leaked: an unreachable object's finalizer may still close or reap it,
    # and a process whose parents are gone may be on its way out.
    deadline = time.monotonic() + grace_s
    while found:
        gc.collect()
        found = _compare(before, take(directories), runtime_dir, known_pids)
        if not found.processes or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return found


def _compare(
    before: Snapshot, after: Snapshot, runtime_dir: Path, known_pids: set[int]
) -> Leaks:
    found = Leaks(processes=_new_processes(before, after, runtime_dir))
    # A new segment is the test's if this process made it, or a process the test left, or one
    # the tests started that is gone (one still running, a module's daemon, keeps its own).
    leaked = {process.pid for process in found.processes}
    found.segments = {
        name: pid
        for name, pid in sorted(after.segments.items())
        if name not in before.segments
        and (pid == _ME or pid in leaked or (pid in known_pids and pid not in after.processes))
    }
    found.sockets = sorted(path for path in after.sockets - before.sockets if path.exists())
    found.threads = [
        f"{thread.name!r}{' (daemon)' if thread.daemon else ''}"
        for ident, thread in after.threads.items()
        if before.threads.get(ident) is not thread and thread.is_alive()
    ]
    python_tids = {thread.native_id for thread in after.threads.values()}
    found.threads += [
        f"native {name!r} (tid {tid})"
        for tid, name in after.tasks.items()
        if tid not in before.tasks
        and tid not in python_tids
        and not any(pattern.fullmatch(name) for pattern in _LONG_LIVED_THREADS)
    ]
    found.fds = [
        f"{fd} -> {target}"
        for fd, target in sorted(after.fds.items())
        if before.fds.get(fd) != target
        and not any(pattern.fullmatch(target) for pattern in _LONG_LIVED_FDS)
    ]
    return found


def _new_processes(before: Snapshot, after: Snapshot, runtime_dir: Path) -> list[Process]:
    """Processes that the test started, directly or not, and that are still there (a child not
    reaped, a zombie, is still there). One started by a process that was already there (a
    module's daemon under its supervisor) is that process's business."""
    old = {process.key for process in before.processes.values()}
    found = []
    for process in after.processes.values():
        if process.key in old or process.pid == _ME:
            continue
        parent = after.processes.get(process.ppid)
        while parent is not None and parent.pid != _ME and parent.key not in old:
            parent = after.processes.get(parent.ppid)
        if parent is None or parent.pid in (0, 1):
            # Its parents are gone (or it was started apart, as autostart does): ours if it
            # carries this session's runtime directory.
            if not _has_runtime_dir(process.pid, runtime_dir):
                continue
        elif parent.pid != _ME:
            continue  # started by a process that was there before the test
        if any(pattern.search(_cmdline(process.pid)) for pattern in _LONG_LIVED_PROCESSES):
            continue
        found.append(process)
    return found


def _describe(process: Process) -> str:
    command = _cmdline(process.pid) or "?"
    if len(command) > 160:
        command = command[:157] + "..."
    zombie = ", exited but not reaped" if process.state == "Z" else ""
    return f"pid {process.pid} ({command}{zombie})"


def _processes() -> dict[int, Process]:
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as file:
                text = file.read().decode(errors="replace")
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid ... starttime": comm may hold spaces and parentheses.
        fields = text[text.rfind(")") + 2 :].split()
        pid = int(entry.name)
        found[pid] = Process(pid, int(fields[1]), int(fields[19]), fields[0])
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _has_runtime_dir(pid: int, runtime_dir: Path) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            environ = file.read().split(b"\0")
    except OSError:
        return False
    want = f"DALID_RUNTIME_DIR={runtime_dir}".encode()
    return any(entry.rstrip(b"/") == want.rstrip(b"/") for entry in environ)


def _socket_files(directories: Iterable[Path]) -> Iterable[Path]:
    for directory in directories:
        for root, _, files in os.walk(directory):
            for name in files:
                path = Path(root, name)
                try:
                    if stat.S_ISSOCK(path.lstat().st_mode):
                        yield path
                except OSError:
                    continue


def _tasks() -> dict[int, str]:
    found = {}
    for entry in os.scandir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry.name}/comm") as file:
                found[int(entry.name)] = file.read().strip()
        except OSError:
            continue
    return found


def _fds() -> dict[int, str]:
    found = {}
    for entry in os.scandir("/proc/self/fd"):
        try:
            found[int(entry.name)] = os.readlink(f"/proc/self/fd/{entry.name}")
        except OSError:
            continue  # the descriptor scandir itself had open
    return found
