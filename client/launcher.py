"""Connecting a trainer to its daemon, starting one on demand (``connect(..., autostart=True)``).

The daemon is started detached (its own session, reparented away from the trainer) so that it
outlives the job that started it, under its supervisor, which restarts it if it crashes; it
exits by itself after ``--idle-timeout`` seconds with no job, and its supervisor with it. Two
trainers racing to start one are safe: the second daemon finds the socket's lock taken and
exits, and both trainers connect to the first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from dalid.protocol import Device, EarlierJob, Envelope, Ping, Pong, Role, endpoint, transport

from .connection import no_daemon_message, process_context
from .errors import DaemonUnavailable
from .link import Link, answering, dial

if TYPE_CHECKING:
    from .reconnect import Dial

AUTOSTART_IDLE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class JobRequest:
    """What a job asks of the daemon at connect; 0 asks for the daemon's default."""

    weight: float = 1.0
    memory_bytes: int = 0
    max_inflight_batches: int = 0


def autostart_connect(
    path: Path,
    device: Device,
    *,
    autostart: bool,
    connect_timeout: float,
    name: str,
    on_push: Callable[[Envelope], None],
    job: JobRequest = JobRequest(),
    hello_timeout: float = 5.0,
    earlier_jobs: tuple[EarlierJob, ...] = (),
) -> Link:
    """A trainer link to the daemon on ``path``, starting one first if allowed."""

    def trainer_connection() -> Link:
        return dial(
            path,
            Role.TRAINER,
            device=device,
            name=name,
            on_push=on_push,
            hello_timeout=hello_timeout,
            weight=job.weight,
            memory_bytes=job.memory_bytes,
            max_inflight_batches=job.max_inflight_batches,
            earlier_jobs=earlier_jobs,
        )

    if answering(path):
        try:
            return trainer_connection()
        except DaemonUnavailable:
            if not autostart:
                raise
            # A socket file no daemon answers on: a killed daemon's. A new one replaces it.
    elif not autostart:
        raise DaemonUnavailable(no_daemon_message(path, device))
    start_daemon(device, path, timeout=connect_timeout)
    return trainer_connection()


def trainer_dial(
    socket: Path, device: Device, *, autostart: bool, name: str, job: JobRequest
) -> Dial:
    """How a session opens its trainer link, to its first daemon and to each one after."""

    def dial(
        *,
        on_push: Callable[[Envelope], None],
        connect_timeout: float,
        hello_timeout: float,
        earlier_jobs: tuple[EarlierJob, ...],
    ) -> Link:
        return autostart_connect(
            socket,
            device,
            autostart=autostart,
            connect_timeout=connect_timeout,
            name=name,
            on_push=on_push,
            job=job,
            hello_timeout=hello_timeout,
            earlier_jobs=earlier_jobs,
        )

    return dial


def log_path(socket: Path) -> Path:
    return socket.with_name(socket.name + ".log")


def start_daemon(
    device: Device,
    socket: Path,
    timeout: float = 60.0,
    idle_timeout: float = AUTOSTART_IDLE_TIMEOUT_S,
) -> None:
    """Starts ``dalid serve`` for ``device`` on ``socket`` and waits until it answers."""
    socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    log = log_path(socket)
    command = [
        sys.executable, "-m", "dalid.server", "serve",
        "--device", str(device), "--socket", str(socket), "--idle-timeout", str(idle_timeout),
    ]  # fmt: skip
    # The shell puts the daemon in the background and exits, so the daemon is nobody's child
    # (no zombie in the trainer) and lives in its own session (no signal from the terminal).
    subprocess.run(
        ["/bin/sh", "-c", 'exec "$@" </dev/null >>"$DALID_LOG" 2>&1 &', "sh", *command],
        env={**os.environ, "DALID_LOG": str(log)},
        start_new_session=True,
        check=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if socket.exists() and _answers(socket):
            # Printed, not logged: the trainer's user must learn where this daemon's log is
            # even when the trainer configures no logging.
            print(
                f"dalid: started a daemon for device {device} on {endpoint(socket)} (it stops "
                f"after {idle_timeout:g} s without jobs); its log is {log}",
                file=sys.stderr,
            )
            return
        time.sleep(0.1)
    raise DaemonUnavailable(
        f"{no_daemon_message(socket, device)}; autostart launched one but it did not answer "
        f"within {timeout:.0f} s. Its log, {log}, ends with:\n{_tail(log)}"
    )


def _answers(socket: Path) -> bool:
    sock = transport.make_socket(process_context(), zmq.DEALER, endpoint(socket), bind=False)
    try:
        transport.send(sock, Ping(), 1)
        if not sock.poll(1000):
            return False
        return isinstance(transport.recv(sock).message, Pong)
    except Exception:
        return False
    finally:
        sock.close(linger=0)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
