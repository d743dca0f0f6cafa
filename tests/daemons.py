"""Starting and stopping real daemon subprocesses for tests.

``start_daemon`` runs ``dalid serve --no-supervisor`` (the daemon is the process the test
holds, so killing it kills the daemon) unless ``supervised``: then the process is the
supervisor, and the daemon is its child (``daemon_pid``), restarted when it crashes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from dalid.protocol import StatusReport

# Directories this test session made for sockets: a daemon whose command line names one of
# them is ours to check for leaks (and never one that another session started).
OWN_DIRECTORIES: list[str] = []
# Processes that tests started through this module (daemons, their supervisors, jobs): a
# segment whose maker is one of them, and gone, was left by a test of this session.
STARTED_PIDS: set[int] = set()


def own_directory(prefix: str = "dlt-") -> Path:
    """A new short directory under /tmp (a socket path has at most 107 bytes), recorded."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    OWN_DIRECTORIES.append(f"{path}/")
    return path


@dataclass
class DaemonProcess:
    socket: Path
    process: subprocess.Popen[bytes]
    log: Path
    supervised: bool = False
    # Every daemon pid seen serving the socket (the supervisor's children, when supervised).
    daemon_pids: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        """The process the test started: the daemon, or its supervisor."""
        return self.process.pid

    def daemon_pid(self, timeout: float = 30.0) -> int:
        """The pid of the daemon answering on the socket now (waiting for one to answer)."""
        if not self.supervised:
            return self.pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = ping_pid(self.socket)
            if pid is not None:
                if pid not in self.daemon_pids:
                    self.daemon_pids.append(pid)
                    STARTED_PIDS.add(pid)
                return pid
            time.sleep(0.05)
        raise AssertionError(f"no daemon answered on {self.socket} within {timeout} s")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def segments(self) -> set[str]:
        """The shared-memory segments of this daemon, of any of its children, past or present."""
        return set(self._segment_labels())

    def status(self) -> StatusReport:
        """The daemon's StatusReport, asked for as ``dalid status`` does."""
        return daemon_status(self.socket)

    def job_segments(self, job_id: int) -> set[str]:
        """The shared-memory segments of the daemon's job ``job_id`` (by their records)."""
        return {name for name, label in self._segment_labels().items() if f"-j{job_id}-" in label}

    def _segment_labels(self) -> dict[str, str]:
        from dalid.protocol import slabs

        pids = {self.pid, *self.daemon_pids, *descendants(self.pid)}
        return {
            path.name: record.label for path, record in slabs.user_segments() if record.pid in pids
        }

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS in /proc status")

    def stop(self, timeout: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                log = self.log_text()
                raise AssertionError(f"daemon did not stop on SIGTERM:\n{log}") from None
        return self.process.returncode


def descendants(pid: int) -> set[int]:
    """The live processes below ``pid``."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def ping_pid(socket: Path, timeout: float = 1.0) -> int | None:
    """The pid in the daemon's answer to a ping on ``socket``; None if none answers."""
    from dalid.protocol import Ping, Pong, endpoint, transport

    if not socket.exists():
        return None
    context = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(socket), bind=False)
    try:
        transport.send(sock, Ping(), 1)
        if sock.poll(int(timeout * 1000)):
            reply = transport.recv(sock).message
            if isinstance(reply, Pong):
                return reply.daemon_pid
        return None
    finally:
        sock.close(linger=0)
        context.term()


def wait_until_answering(
    socket: Path, process: subprocess.Popen[bytes], timeout: float = 60.0
) -> None:
    from dalid.protocol import Ping, Pong, endpoint, transport

    deadline = time.monotonic() + timeout
    context = zmq.Context()
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(f"daemon exited with {process.returncode}")
            if socket.exists():
                sock = transport.make_socket(context, zmq.DEALER, endpoint(socket), bind=False)
                try:
                    transport.send(sock, Ping(), 1)
                    if sock.poll(1000) and isinstance(transport.recv(sock).message, Pong):
                        return
                finally:
                    sock.close(linger=0)
            time.sleep(0.05)
    finally:
        context.term()
    raise AssertionError(f"daemon did not answer on {socket} within {timeout} s")


def daemon_status(socket: Path, timeout: float = 10.0) -> StatusReport:
    """One StatusReport from the daemon on ``socket`` (a status request needs no hello)."""
    from dalid.protocol import StatusRequest, endpoint, transport

    context = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(socket), bind=False)
    try:
        transport.send(sock, StatusRequest(), 1)
        if not sock.poll(int(timeout * 1000)):
            raise AssertionError(f"no status from {socket} within {timeout} s")
        report = transport.recv(sock).message
        assert isinstance(report, StatusReport), report
        return report
    finally:
        sock.close(linger=0)
        context.term()


def start_daemon(
    directory: Path,
    *args: str,
    name: str = "d",
    supervised: bool = False,
    module: str = "dalid.server",
    log_name: str = "",
) -> DaemonProcess:
    """``module``: what runs ``serve`` (tests.simulated_gpu: the daemon on a simulated GPU);
    ``log_name``: its log's name when not ``name`` (a daemon replacing another on its socket)."""
    socket = directory / f"{name}.sock"
    log = directory / f"{log_name or name}.log"
    command = [sys.executable, "-m", module, "serve", "--socket", str(socket), *args]
    if not supervised:
        command.append("--no-supervisor")
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    STARTED_PIDS.add(process.pid)
    daemon = DaemonProcess(socket, process, log, supervised)
    try:
        wait_until_answering(socket, process)
        daemon.daemon_pid()
    except BaseException:
        daemon.stop()
        raise
    return daemon


@contextlib.contextmanager
def module_daemon(*args: str, supervised: bool = False) -> Iterator[DaemonProcess]:
    """A daemon in a directory of its own for the tests of one module (a fixture yields from
    it): stopped at the end, which must be clean (exit 0, no shared memory, no socket file)."""
    directory = own_directory()
    running = start_daemon(directory, *args, supervised=supervised)
    try:
        yield running
    finally:
        code = running.stop()
        segments = running.segments()
        socket_left = running.socket.exists()
        log = running.log_text()
        shutil.rmtree(directory, ignore_errors=True)
    assert code == 0, f"daemon exited with {code}:\n{log}"
    assert not segments, f"daemon left shared memory: {segments}"
    assert not socket_left, "daemon left its socket file"


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls ``condition`` until it holds; fails the test naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


ROOT = Path(__file__).resolve().parents[1]


def start_job(module: str, socket: Path, *args: str) -> subprocess.Popen[str]:
    """A job script of tests/integration (``trainer_job``, ``load_job``, ...) as its own
    process, talking to the daemon on ``socket``; its stdout and stderr in one text pipe."""
    job = subprocess.Popen(
        [sys.executable, "-m", f"tests.integration.{module}", "--socket", str(socket), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    STARTED_PIDS.add(job.pid)
    return job


def kill_leftovers(jobs: Iterable[subprocess.Popen[str]]) -> None:
    """Kills the job processes still running (a test that failed half-way) and reaps them."""
    for job in jobs:
        if job.poll() is None:
            job.kill()
            job.communicate()


def alive(pid: int) -> bool:
    """Whether ``pid`` is still there (a zombie not yet reaped counts: tests reap their own)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
