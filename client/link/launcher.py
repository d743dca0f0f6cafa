"""Connecting a trainer to its daemon, starting one on demand (``connect(..., autostart=True)``).

The daemon is started detached (its own session, reparented away from the trainer) so that it
outlives the job that started it, under its supervisor, which restarts it if it crashes; it
exits by itself after ``--idle-timeout`` seconds with no job, and its supervisor with it. Two
trainers racing to start one are safe: the second daemon finds the socket's lock taken and
exits, and both trainers connect to the first.

Only the default daemon is started so: the one of the device's socket in the runtime directory.
A socket the trainer was given (``socket=``, ``$DALID_SOCKET``) names a daemon someone runs
there; nothing answering on it is an error that names it, not a reason to start a second
daemon on a mistyped path. A trainer welcomed by a daemon of another release, or of another
installation on this machine (another checkout's environment started the default daemon first),
warns once, naming both; a daemon in another container with its own installation of the same
release is no mix-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import zmq

from dalid.protocol import (
    SOCKET_ENV,
    Device,
    EarlierJob,
    Envelope,
    Ping,
    Pong,
    Role,
    device_label,
    endpoint,
    installation,
    release,
    runtime_dir,
    transport,
)
from dalid.protocol.ownership import UnsafePath

from ..errors import DaemonUnavailable
from .connection import no_daemon_message, process_context
from .link import Link, answering, dial

AUTOSTART_IDLE_TIMEOUT_S = 60.0


class OtherInstallationWarning(UserWarning):
    """The daemon on the trainer's socket runs another dalid release or installation."""


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
            return _checked(trainer_connection())
        except DaemonUnavailable:
            if not autostart or not is_default_socket(path, device):
                raise
            # A socket file no daemon answers on: a killed daemon's. A new one replaces it.
    elif not autostart:
        raise DaemonUnavailable(no_daemon_message(path, device))
    elif not is_default_socket(path, device):
        raise DaemonUnavailable(
            f"no dalid daemon answers on {endpoint(path)}, the socket this trainer was given "
            f"(socket= or ${SOCKET_ENV}); autostart starts a daemon only on the default socket "
            f"of device {device}, {_default_socket(device)}. Check the path, or start a daemon "
            f"there with `dalid serve --device {device} --socket {path}`"
        )
    start_daemon(device, path, timeout=connect_timeout)
    return _checked(trainer_connection())


def _default_socket(device: Device) -> Path | None:
    try:
        return (runtime_dir(create=False) / f"{device_label(device)}.sock").absolute()
    except (OSError, UnsafePath):
        return None


def is_default_socket(path: Path, device: Device) -> bool:
    """Whether ``path`` is where dalid places the daemon of ``device`` by itself: the device's
    socket in the runtime directory (or a GPU daemon's link there, named by the GPU's UUID)."""
    default = _default_socket(device)
    if default is None:
        return False
    return path == default or (
        path.parent == default.parent and path.name.startswith("GPU-") and device != "cpu"
    )


# The daemons (socket, pid) this process warned about: one warning each.
_warned: set[tuple[Path, int]] = set()


def _checked(link: Link) -> Link:
    """``link``, after a warning if its daemon runs another dalid than this process."""
    welcome = link.welcome
    mine = (release(), installation())
    if welcome.release == mine[0] and (
        welcome.installation == mine[1]
        # Another container's installation of the same release (another path, or none here)
        # is a deployment, not a mix-up: only two installations on one filesystem are.
        or (welcome.installation and not Path(welcome.installation).exists())
    ):
        return link
    if (link.path, welcome.daemon_pid) in _warned:
        return link
    _warned.add((link.path, welcome.daemon_pid))
    theirs = (
        f"dalid {welcome.release or '(release unknown)'} from {welcome.installation}"
        if welcome.installation
        else "a dalid release that does not say which (an older one)"
    )
    warnings.warn(
        f"the dalid daemon on {endpoint(link.path)} (pid {welcome.daemon_pid}) runs {theirs}; "
        f"this trainer runs dalid {mine[0] or '(release unknown)'} from {mine[1]}. Another "
        "installation's daemon runs its own code and options: stop it "
        f"(`dalid stop --socket {link.path}`) and this trainer starts its own, or give this "
        "trainer a socket of its own",
        OtherInstallationWarning,
        stacklevel=2,
    )
    return link


class Dial(Protocol):
    """Opens a trainer link to the daemon on the session's socket (starting one if allowed)."""

    def __call__(
        self,
        *,
        on_push: Callable[[Envelope], None],
        connect_timeout: float,
        hello_timeout: float,
        earlier_jobs: tuple[EarlierJob, ...],
        may_start: bool = True,
    ) -> Link: ...


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
        may_start: bool = True,
    ) -> Link:
        return autostart_connect(
            socket,
            device,
            autostart=autostart and may_start,
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
        pid = _answers(socket) if socket.exists() else None
        if pid is not None:
            # Printed, not logged: the trainer's user must learn where this daemon's log is
            # even when the trainer configures no logging.
            print(
                f"dalid: started a daemon (pid {pid}) for device {device} on {endpoint(socket)} "
                f"(it stops after {idle_timeout:g} s without jobs); its log is {log}",
                file=sys.stderr,
            )
            return
        time.sleep(0.1)
    raise DaemonUnavailable(
        f"{no_daemon_message(socket, device)}; autostart launched one but it did not answer "
        f"within {timeout:.0f} s. Its log, {log}, ends with:\n{_tail(log)}"
    )


def _answers(socket: Path) -> int | None:
    """The pid of the daemon that answers a ping on ``socket`` (None: none does)."""
    sock = transport.make_socket(process_context(), zmq.DEALER, endpoint(socket), bind=False)
    try:
        transport.send(sock, Ping(), 1)
        if not sock.poll(1000):
            return None
        reply = transport.recv(sock).message
        return reply.daemon_pid if isinstance(reply, Pong) else None
    except Exception:
        return None
    finally:
        sock.close(linger=0)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
