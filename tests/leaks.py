"""What a test left behind: a snapshot before each test and one after, and the difference
between them, named by the test.

A snapshot reads ``/proc`` and ``/dev/shm`` once (no sleeps): the processes (with their parents),
dalid's shared-memory segments (with the process that made each, from its record), the socket
files in the directories the tests made, and this process's Python threads, native threads and
open file descriptors. What a test made and left is a leak; what it found already there is not
(a module's shared daemon), nor is what something already there made during the test (a shared
daemon's restarts, its segments).

What a test left outside this process (processes, segments other processes made, socket files)
is judged when the test ends. What it left in this process (threads, file descriptors, segments
this process made) may belong to a fixture wider than the test (a module's client session maps
the slabs a test's batch needed, a connection opens when first used): that is judged once the
module's fixtures are gone (:func:`still_there`), and still named by the test that made it.

Process-wide state that a library makes on first use and keeps until the process exits is made
once, before the first snapshot (``_LONG_LIVED_STATE``, each entry with its reason), so that it
is there before every test: no test is blamed for it, and no test is excused a leak of the same
kind (a ZeroMQ context of its own, say), which a pattern over names could not tell apart.

What libraries below dalid make in this process on their own later on (the CUDA driver's and
jemalloc's named threads, the driver's file in /dev/shm) is told apart by :mod:`tests.foreign`,
by name and origin; so is a native thread nobody named in a test that ran only code that is not
dalid's (``foreign_code``: DALI's own proxy).

Over 400 lines, as one idea: taking the snapshots, telling what in them is a test's, and
naming it belong together; what is not dalid's is in :mod:`tests.foreign`.

Only when something looks leaked is time spent: garbage is collected (an object whose
finalizer closes a socket or reaps a child may only be unreachable), and processes whose
parents are gone (a killed job's DataLoader workers notice by polling, every 5 s) and threads
told to stop are given a few seconds before what is still there is named.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import torch
import zmq

from dalid.client.link import connection
from dalid.protocol import slabs

from . import foreign

_ME = os.getpid()


def _zmq_process_context() -> None:
    # ZeroMQ starts a context's threads (and their epoll and eventfd descriptors) with its first
    # socket, not with the context.
    connection.process_context().socket(zmq.DEALER).close(linger=0)


def _zmq_garbage_collector() -> None:
    # One zero-copy send makes it, as it would in a test: its thread, context and PUSH socket.
    context: zmq.Context[Any] = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        receiver.bind("inproc://dalid-leaks-warm-up")
        sender.connect("inproc://dalid-leaks-warm-up")
        sender.send(bytes(1 << 16), copy=False)
        receiver.recv()
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
        context.term()


def _cuda_context() -> None:
    # The first CUDA call of a process makes its context, and with it the driver's
    # 'cuda-EvtHandlr' thread, descriptors on /dev/nvidia* and /dev/nvidia-uvm, and a
    # /dev/shm/cuda.shm.* segment, all kept until the process exits. Nothing without CUDA.
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()


def _dali_gpu_decoding() -> None:
    # A GPU pipeline run in this process (the GPU tests' references) loads DALI's GPU decoding
    # libraries, whose allocator starts a 'jemalloc_bg_thd' thread that never stops; one tiny
    # run of the mixed decoder makes that state here, once. Nothing without CUDA.
    if not torch.cuda.is_available():
        return
    import io

    import numpy as np
    from nvidia.dali import fn
    from nvidia.dali.pipeline import Pipeline
    from PIL import Image

    # Images large enough for the hardware decoder too, which takes part of each run.
    encoded = io.BytesIO()
    Image.radial_gradient("L").convert("RGB").resize((320, 240)).save(encoded, format="JPEG")
    jpeg = np.frombuffer(encoded.getvalue(), np.uint8)
    pipe = Pipeline(batch_size=4, num_threads=1, device_id=0, prefetch_queue_depth=1)
    with pipe:
        pipe.set_outputs(fn.decoders.image(fn.external_source(name="jpegs"), device="mixed"))
    try:
        pipe.build()
        pipe.run(jpegs=[jpeg] * 4)
    finally:
        pipe._shutdown()  # its worker threads end with it; the libraries' state stays
    del pipe
    gc.collect()


# Process-wide state that is made on first use and kept until the process exits; each is made
# by start_long_lived, before the first snapshot.
_LONG_LIVED_STATE: dict[str, Callable[[], object]] = {
    # dalid.client.link.connection.process_context: the client's ZeroMQ context (its I/O and reaper
    # threads, an epoll and eventfd mailboxes) lives as long as the process, by design.
    "dalid's ZeroMQ context of the process": _zmq_process_context,
    # pyzmq frees a zero-copy frame once ZeroMQ is done with it through a thread with a context
    # and a PUSH socket of its own, started by the first zero-copy send and never stopped.
    "pyzmq's garbage collector": _zmq_garbage_collector,
    # multiprocessing's resource tracker: a process, and a pipe to it, started by the first
    # SharedMemory or semaphore of a process (a DataLoader with workers makes some); it unlinks
    # what a crashed process left, and exits only when this process does.
    "multiprocessing's resource tracker": resource_tracker.ensure_running,
    # torch's intra-op thread pool (OpenMP): started by the first operation large enough to be
    # split between threads, and kept for the next ones.
    "torch's OpenMP threads": lambda: torch.ones(1 << 20).add_(1),
    # SciPy's OpenBLAS (loaded by scikit-learn, which the tests' JPEGs come from) starts its
    # thread pool when the library loads, and never stops it.
    "SciPy's OpenBLAS threads": lambda: importlib.import_module("scipy.linalg"),
    # CUDA's context of the process (on a machine with a GPU): see _cuda_context.
    "CUDA's context": _cuda_context,
    # DALI's GPU decoding libraries and their allocator's thread: see _dali_gpu_decoding.
    "DALI's GPU decoding": _dali_gpu_decoding,
}


def start_long_lived() -> None:
    """Makes the process-wide state of ``_LONG_LIVED_STATE``; call once, before any snapshot."""
    for make in _LONG_LIVED_STATE.values():
        make()


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
    """What a test left, by kind (false if nothing)."""

    processes: list[Process] = field(default_factory=list)
    segments: dict[str, int] = field(default_factory=dict)  # name -> pid that made it
    sockets: list[Path] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)  # Python threads
    tasks: dict[int, str] = field(default_factory=dict)  # other native threads: tid -> name
    fds: dict[int, str] = field(default_factory=dict)  # descriptor -> what it points to

    def __bool__(self) -> bool:
        return any(vars(self).values())

    def lines(self) -> list[str]:
        """One line per kind, naming each thing."""
        kinds = {
            "processes": [_describe(process) for process in self.processes],
            "/dev/shm segments": [
                f"{name} (made by pid {pid})" for name, pid in self.segments.items()
            ],
            "socket files": [str(path) for path in self.sockets],
            "threads": [
                f"{thread.name!r}{' (daemon)' if thread.daemon else ''}" for thread in self.threads
            ]
            + [f"native {name!r} (tid {tid})" for tid, name in self.tasks.items()],
            "file descriptors": [f"{fd} -> {target}" for fd, target in self.fds.items()],
        }
        return [f"{kind}: {', '.join(items)}" for kind, items in kinds.items() if items]

    def clean_up(self) -> None:
        """Kills the processes, reaps those that are this process's children, and removes the
        segments and socket files, so that the tests after this one start clean (threads and
        descriptors are left to their owners)."""
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


def left_behind(
    before: Snapshot,
    directories: Iterable[Path],
    runtime_dir: Path,
    known_pids: set[int],
    *,
    grace_s: float = 10.0,
    foreign_code: str | None = None,
) -> tuple[Leaks, Leaks]:
    """What was made since ``before`` and is still there: what is outside this process, settled
    (false if nothing), and what is in this process, as it is now (judge it with
    :func:`still_there` once wider fixtures are gone).

    ``runtime_dir`` is the tests' $DALID_RUNTIME_DIR: a process whose parents are gone is ours
    if it has it in its environment. ``known_pids`` are processes the tests started (so a
    dead one's segments are ours, and never another test session's on the same machine).
    ``foreign_code`` names the code under test when it is not dalid's (see :mod:`tests.foreign`).
    """
    directories = list(directories)
    outside, inside = _compare(before, take(directories), runtime_dir, known_pids, foreign_code)
    # Something looks leaked: an unreachable object's finalizer may still close or reap it,
    # and a process whose parents are gone may be on its way out.
    deadline = time.monotonic() + grace_s
    while outside:
        gc.collect()
        outside, inside = _compare(before, take(directories), runtime_dir, known_pids, foreign_code)
        if not outside.processes or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return outside, inside


def still_there(made: Leaks, grace_s: float = 10.0) -> Leaks:
    """Those of ``made`` (threads, descriptors and segments of this process) that are still
    there, after a garbage collection and, for threads, up to ``grace_s`` seconds."""
    found = _still_there(made)
    deadline = time.monotonic() + grace_s
    while found:
        gc.collect()
        found = _still_there(made)
        if not (found.threads or found.tasks) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return found


def _still_there(made: Leaks) -> Leaks:
    tasks, fds = _tasks(), _fds()
    return Leaks(
        segments={
            name: pid for name, pid in made.segments.items() if (slabs.SHM_DIR / name).exists()
        },
        threads=[thread for thread in made.threads if thread.is_alive()],
        tasks={tid: name for tid, name in made.tasks.items() if tasks.get(tid) == name},
        fds={fd: target for fd, target in made.fds.items() if fds.get(fd) == target},
    )


def _compare(
    before: Snapshot,
    after: Snapshot,
    runtime_dir: Path,
    known_pids: set[int],
    foreign_code: str | None = None,
) -> tuple[Leaks, Leaks]:
    outside = Leaks(processes=_new_processes(before, after, runtime_dir))
    # A new segment is the test's if this process made it, or a process the test left, or one
    # the tests started that is gone (one still running, a module's daemon, keeps its own).
    leaked = {process.pid for process in outside.processes}
    new_segments = sorted(
        (name, pid) for name, pid in after.segments.items() if name not in before.segments
    )
    outside.segments = {
        name: pid
        for name, pid in new_segments
        if pid in leaked or (pid in known_pids and pid != _ME and pid not in after.processes)
    }
    outside.sockets = sorted(path for path in after.sockets - before.sockets if path.exists())
    python_tids = {thread.native_id for thread in after.threads.values()}
    inside = Leaks(
        segments={name: pid for name, pid in new_segments if pid == _ME},
        threads=[
            thread
            for ident, thread in after.threads.items()
            if before.threads.get(ident) is not thread and thread.is_alive()
        ],
        tasks={
            tid: name
            for tid, name in after.tasks.items()
            if tid not in before.tasks
            and tid not in python_tids
            and foreign.foreign_thread(name, foreign_code) is None
        },
        fds={
            fd: target
            for fd, target in sorted(after.fds.items())
            if before.fds.get(fd) != target and not foreign.driver_file(target)
        },
    )
    return outside, inside


def _new_processes(before: Snapshot, after: Snapshot, runtime_dir: Path) -> list[Process]:
    """Processes that the test started, directly or not, and that are still there (a child not
    reaped, a zombie, is still there). One started by a process that was already there (a
    module's daemon under its supervisor) is that process's business."""
    old = {process.key for process in before.processes.values()}
    # An orphan is adopted by init, or by the nearest of this process's ancestors that asked to
    # reap its descendants' orphans (PR_SET_CHILD_SUBREAPER): either way, an ancestor of ours.
    adopters = {0, *_ancestors(after.processes)}
    found = []
    for process in after.processes.values():
        if process.key in old or process.pid == _ME:
            continue
        parent = after.processes.get(process.ppid)
        while parent is not None and parent.pid != _ME and parent.key not in old:
            parent = after.processes.get(parent.ppid)
        if parent is None or parent.pid in adopters:
            # Its parents are gone (or it was started apart, as autostart does): ours if it
            # carries this session's runtime directory, as no other session's process does.
            if not _has_runtime_dir(process.pid, runtime_dir):
                continue
        elif parent.pid != _ME:
            continue  # started by a process that was there before the test
        found.append(process)
    return found


def _ancestors(processes: dict[int, Process]) -> set[int]:
    found: set[int] = set()
    process = processes.get(_ME)
    while process is not None and process.ppid not in found and process.ppid != 0:
        found.add(process.ppid)
        process = processes.get(process.ppid)
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
    for name in os.listdir("/proc/self/fd"):
        try:
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the descriptor listdir itself had open, closed since
    return found
