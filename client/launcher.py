"""Starting a daemon on demand (``connect(..., autostart=True)``).

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
from pathlib import Path

import zmq

from dalid.protocol import Device, Ping, Pong, endpoint, transport

from .connection import no_daemon_message, process_context
from .errors import DaemonUnavailable

AUTOSTART_IDLE_TIMEOUT_S = 60.0


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
