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
    process_running,
    release,
    runtime_dir,
    transport,
)
from dalid.protocol.ownership import UnsafePath

from ..errors import DaemonUnavailable
from .advice import Advice
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
    reconnect: bool = False,
) -> Link:
    """A trainer link to the daemon on ``path``, starting one first if allowed."""
    default = is_default_socket(path, device)
    advice = Advice(autostarts=autostart and default, default_socket=default, reconnects=reconnect)

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
            advice=advice,
        )

    if answering(path):
        try:
            return _checked(trainer_connection(), advice)
        except DaemonUnavailable:
            if not advice.autostarts:
                raise
            # A socket file no daemon answers on: a killed daemon's. A new one replaces it.
    elif not autostart:
        raise DaemonUnavailable(no_daemon_message(path, device, advice))
    elif not default:
        raise DaemonUnavailable(
            f"no dalid daemon answers on {endpoint(path)}, the socket this trainer was given "
            f"(socket= or ${SOCKET_ENV}); autostart starts a daemon only on the default socket "
            f"of device {device}, {_default_socket(device)}. Check the path, or start a daemon "
            f"there with `dalid serve --device {device} --socket {path}`"
        )
    start_daemon(device, path, timeout=connect_timeout)
    return _checked(trainer_connection(), advice)


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


def _checked(link: Link, advice: Advice) -> Link:
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
    # Only a trainer that autostarts would start its own daemon there by itself.
    then = (
        "this trainer starts its own"
        if advice.autostarts
        else f"start this installation's (`dalid serve --socket {link.path}`)"
    )
    theirs = (
        f"dalid {welcome.release or '(release unknown)'} from {welcome.installation}"
        if welcome.installation
        else "a dalid release that does not say which (an older one)"
    )
    warnings.warn(
        f"the dalid daemon on {endpoint(link.path)} (pid {welcome.daemon_pid}) runs {theirs}; "
        f"this trainer runs dalid {mine[0] or '(release unknown)'} from {mine[1]}. Another "
        "installation's daemon runs its own code and options: stop it "
        f"(`dalid stop --socket {link.path}`) and {then}, or give this trainer a socket of its "
        "own",
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
    socket: Path, device: Device, *, autostart: bool, name: str, job: JobRequest, reconnect: bool
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
            reconnect=reconnect,
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
    """Starts ``dalid serve`` for ``device`` on ``socket`` and waits until it answers.

    A daemon that exits before it answers (a GPU it cannot serve, say) raises at once with what
    its log says of this start; the log keeps earlier starts' lines, which are left out.
    """
    socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    log = log_path(socket)
    try:
        earlier = log.stat().st_size
    except FileNotFoundError:
        earlier = 0
    command = [
        sys.executable, "-m", "dalid.server", "serve",
        "--device", str(device), "--socket", str(socket), "--idle-timeout", str(idle_timeout),
    ]  # fmt: skip
    # The shell puts the daemon in the background, says its pid and exits, so the daemon is
    # nobody's child (no zombie in the trainer) and lives in its own session (no signal from
    # the terminal).
    started = subprocess.run(
        ["/bin/sh", "-c", 'exec "$@" </dev/null >>"$DALID_LOG" 2>&1 & echo $!', "sh", *command],
        env={**os.environ, "DALID_LOG": str(log)},
        start_new_session=True,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    supervisor = int(started.stdout.split()[-1])
    deadline = time.monotonic() + timeout
    raced = False
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
        if not raced and not process_running(supervisor):
            lines = _since(log, earlier)
            # Another trainer's daemon took the socket first: ours exited, and that one answers.
            raced = any("already serves" in line for line in lines)
            if not raced:
                raise DaemonUnavailable(exited_message(device, socket, supervisor, lines))
        time.sleep(0.1)
    raise DaemonUnavailable(
        f"autostart started a dalid daemon (pid {supervisor}) for device {device} on "
        f"{endpoint(socket)}, but it did not answer within {timeout:.0f} s. Its log "
        f"({log}) of this start ends with:\n{_tail(_since(log, earlier))}"
    )


def exited_message(device: Device, socket: Path, pid: int, lines: list[str]) -> str:
    """Why an autostarted daemon exited before it answered: its errors first, from ``lines``
    (its log of this start), then the log itself."""
    errors = [line.split(" ERROR ", 1)[1] for line in lines if " ERROR " in line]
    cause = "; ".join(error.rstrip(".") for error in errors) or "its log says nothing of why"
    advice = (
        " A GPU pipeline needs a GPU the daemon can use: on a machine without one, build the "
        "pipeline with device_id=None (CPU operators) and connect to the CPU daemon."
        if device != "cpu" and any("cannot serve GPU" in error for error in errors)
        else ""
    )
    return (
        f"autostart started a dalid daemon (pid {pid}) for device {device} on "
        f"{endpoint(socket)}, and it exited before it answered: {cause}.{advice} Its log "
        f"({log_path(socket)}) of this start:\n{_tail(lines)}"
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


def _since(path: Path, offset: int) -> list[str]:
    """The lines written to ``path`` past ``offset`` (this start's, not earlier starts')."""
    try:
        with path.open("rb") as file:
            file.seek(offset)
            return file.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def _tail(lines: list[str], shown: int = 20) -> str:
    return "\n".join(lines[-shown:]) if lines else "(nothing)"
