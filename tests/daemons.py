"""Starting and stopping real daemon subprocesses for tests."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

# Directories this test session made for sockets: a daemon whose command line names one of
# them is ours to check for leaks (and never one that another session started).
OWN_DIRECTORIES: list[str] = []


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

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def segments(self) -> set[str]:
        return {p.name for p in Path("/dev/shm").glob(f"dalid-{self.pid}-*")}

    def status(self) -> Any:
        """The daemon's StatusReport, asked for as ``dalid status`` does."""
        return daemon_status(self.socket)

    def job_segments(self, job_id: int) -> set[str]:
        return {name for name in self.segments() if f"-j{job_id}-" in name}

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


def daemon_status(socket: Path, timeout: float = 10.0) -> Any:
    """One StatusReport from the daemon on ``socket`` (a status request needs no hello)."""
    from dalid.protocol import StatusReport, StatusRequest, endpoint, transport

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


def start_daemon(directory: Path, *args: str, name: str = "d") -> DaemonProcess:
    socket = directory / f"{name}.sock"
    log = directory / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dalid.server", "serve", "--socket", str(socket), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    daemon = DaemonProcess(socket, process, log)
    try:
        wait_until_answering(socket, process)
    except BaseException:
        daemon.stop()
        raise
    return daemon


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls ``condition`` until it holds; fails the test naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def kill_leftovers(jobs: Iterable[subprocess.Popen[str]]) -> None:
    """Kills the job processes still running (a test that failed half-way) and reaps them."""
    for job in jobs:
        if job.poll() is None:
            job.kill()
            job.communicate()
