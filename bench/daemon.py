"""A dalid daemon subprocess for one benchmark run, stopped with SIGTERM and checked after.

The bench starts a fresh daemon for every run of a dalid contender, so that its peak memory
and CPU time belong to that run, and checks afterwards that it left no shared memory behind.
Trainers read the daemon's pipelines and jobs from its status (:func:`status_reading`) as their
timed window ends; the weighted run's orchestrator reads the jobs' queues while they run
(:class:`QueueWatch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from dalid.protocol import (
    Ping,
    Pong,
    ProtocolError,
    StatusReport,
    StatusRequest,
    endpoint,
    slabs,
    transport,
)

from .threads import THREADS_ENV, read_snapshots

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
STATUS_TIMEOUT_S = 10.0


class DaemonFailed(RuntimeError):
    """The daemon did not start, did not stop cleanly, or left segments behind."""


@dataclass(frozen=True)
class RunningDaemon:
    pid: int
    socket: Path
    log: Path
    # Snapshots of what the daemon's own threads used (bench.threads), read once it exited.
    threads: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def _answers(socket: Path) -> bool:
    """Whether a daemon answers a ping on ``socket`` within a second."""
    context: zmq.Context[Any] = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(socket), bind=False)
    try:
        transport.send(sock, Ping(), 1)
        return bool(sock.poll(1000)) and isinstance(transport.recv(sock).message, Pong)
    except ProtocolError as error:
        # A daemon of another dalid version, say: it will never answer this bench.
        raise DaemonFailed(f"the daemon answered, but not as expected: {error}") from None
    finally:
        sock.close(linger=0)
        context.term()


def status_reading(socket: Path, timeout: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
    """The daemon's pipelines (``StatusReport.pipelines``, as ``dalid status --json`` shows
    them) and, of each job, its id, slabs, their peak bytes and output path, from the daemon
    on ``socket``; a status request needs no hello."""
    context: zmq.Context[Any] = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(socket), bind=False)
    try:
        transport.send(sock, StatusRequest(), 1)
        if not sock.poll(int(timeout * 1000)):
            raise DaemonFailed(f"the daemon on {socket} sent no status within {timeout:.0f} s")
        report = transport.recv(sock).message
        if not isinstance(report, StatusReport):
            raise DaemonFailed(f"the daemon answered a status request with {report!r}")
        jobs = [
            {
                "job_id": job.job_id,
                "slabs": job.slabs,
                "output_path": job.output_path,
                "weight": job.weight,
                "queued": job.queued,
                "running": job.running,
                "waiting": job.waiting,
                "samples_done": job.samples_done,
                "batches_copied": job.batches_copied,
                "peak_slab_bytes": job.peak_slab_bytes,
            }
            for job in report.jobs
        ]
        return {
            "pipelines": [dataclasses.asdict(p) for p in report.pipelines],
            "jobs": jobs,
            "cohorts": [dataclasses.asdict(c) for c in report.cohorts],
        }
    finally:
        sock.close(linger=0)
        context.term()


class QueueWatch:
    """Reads the daemon's jobs (their queues, weights and samples done) on a thread every
    ``interval_s`` from start to stop, into ``readings`` (``{"t_ns", "jobs"}``, as
    :func:`status_reading` has them); readings that fail are left out."""

    def __init__(self, socket: Path, interval_s: float) -> None:
        self.socket = socket
        self.interval_s = interval_s
        self.readings: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-queues", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t_ns = time.monotonic_ns()
            with contextlib.suppress(DaemonFailed, ProtocolError, zmq.ZMQError, OSError):
                reading = status_reading(self.socket, timeout=max(1.0, self.interval_s))
                self.readings.append(
                    {"t_ns": t_ns, "jobs": reading["jobs"], "cohorts": reading["cohorts"]}
                )
            self._stop.wait(self.interval_s)

    @contextlib.contextmanager
    def running(self) -> Iterator[QueueWatch]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


def _segments(pid: int) -> list[str]:
    return sorted(path.name for path, record in slabs.user_segments() if record.pid == pid)


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def running_daemon(
    device: str, log_dir: Path, options: tuple[str, ...] = ()
) -> Iterator[RunningDaemon]:
    """Runs ``dalid serve`` (with ``options``) on a private socket until the block ends, then
    SIGTERM and wait. The daemon runs with the probes of :mod:`bench.threads`: once it has
    exited, ``threads`` of the yielded daemon holds the snapshots of what its own threads used.

    Raises :class:`DaemonFailed` when the daemon exits with an error or leaves ``/dev/shm``
    segments behind (they are removed, and the failure names them).
    """
    # A short private directory: a socket path may hold at most 107 bytes.
    directory = Path(tempfile.mkdtemp(prefix="dalidb-", dir="/tmp"))
    socket = directory / "d.sock"
    log = log_dir / f"daemon-{time.monotonic_ns()}.log"
    threads = directory / "threads.jsonl"
    # Without the supervisor, the process measured (CPU time, memory, segments) is the daemon.
    command = [
        sys.executable, "-m", "bench.threads", "serve", "--no-supervisor", "--device", device,
        "--socket", str(socket), "--log-level", "WARNING", *options,
    ]  # fmt: skip
    env = {**os.environ, THREADS_ENV: str(threads)}
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env
        )
    daemon = RunningDaemon(process.pid, socket, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (socket.exists() and _answers(socket)):
            if process.poll() is not None or time.monotonic() > deadline:
                raise DaemonFailed(f"the dalid daemon did not start; its log ends:\n{_tail(log)}")
            time.sleep(0.05)
        yield daemon
    finally:
        code = terminate(process)
        leaked = _segments(process.pid)
        for name in leaked:
            (slabs.SHM_DIR / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            daemon.threads.extend(read_snapshots(threads))
        shutil.rmtree(directory, ignore_errors=True)
    if code != 0 or leaked:
        raise DaemonFailed(
            f"the dalid daemon (pid {process.pid}) exited with {code} after SIGTERM and left "
            f"{leaked or 'no'} shared-memory segments; its log ends:\n{_tail(log)}"
        )


def terminate(process: subprocess.Popen[Any]) -> int | None:
    """SIGTERM to ``process``, and its exit status; killed (None) if it has not exited within
    STOP_TIMEOUT_S."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None
