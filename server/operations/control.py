"""The commands that ask a running daemon: ``dalid status``, ``dalid stop``, ``dalid ping`` and
``dalid reload``, each over a :class:`DaemonLine` (requests that need no hello).

Whoever can open the socket (mode 0600, its user) may send them. ``dalid status`` renders the
report with :mod:`dalid.server.operations.status_view`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from dalid.protocol import (
    SOCKET_ENV,
    Device,
    Error,
    ErrorCode,
    Message,
    Ping,
    Pong,
    ProtocolError,
    ReloadRepository,
    RepositoryReport,
    Shutdown,
    StatusReport,
    StatusRequest,
    daemon_socket,
    device_label,
    endpoint,
    runtime_dir,
    transport,
)
from dalid.protocol.ownership import UnsafePath

from . import crash_report

# `dalid reload`: the daemon reloaded, but some files failed to load.
EXIT_LOAD_FAILED = 3


# How often a request waiting for its answer looks whether the daemon's socket is still there.
_GONE_CHECK_S = 0.1
# How long a command waits quietly (for an answer, for `dalid stop` to take effect) before it
# says what it waits for: a daemon answers, and stops, in a fraction of that.
QUIET_S = 1.0


class NoAnswer(Exception):
    """The daemon is not there or did not answer; the message says which."""


def start_command(device: Device, path: Path) -> str:
    """The command that starts a daemon for ``device`` on ``path``: with ``--socket`` unless
    ``dalid serve`` would choose that socket by itself."""
    command = f"dalid serve --device {device}"
    chosen = os.environ.get(SOCKET_ENV)
    try:
        default = (
            Path(chosen).absolute()
            if chosen
            else runtime_dir(create=False) / f"{device_label(device)}.sock"
        )
    except OSError:
        return f"{command} --socket {path}"
    return command if path == default else f"{command} --socket {path}"


class DaemonLine:
    """A connection for requests that need no hello (ping, status, shutdown). Closes once.

    ``start`` is the command that starts the daemon, for the message when none answers."""

    def __init__(self, path: Path, timeout: float, start: str) -> None:
        self.path = path
        self.timeout = timeout
        self.start = start
        target = self._verified(path, timeout)
        self._context: zmq.Context[Any] = zmq.Context()
        self._socket = transport.make_socket(
            self._context, zmq.DEALER, endpoint(target), bind=False
        )
        self._request_ids = iter(range(1, 1 << 62))

    def _verified(self, path: Path, timeout: float) -> Path:
        """The socket of the user's own daemon on ``path`` (only it is asked, or told to stop).
        A socket file there that nothing listens on yet (a daemon being restarted) is tried
        again until ``timeout``."""
        absent = f"no dalid daemon listens on {endpoint(path)}: start one with `{self.start}`"
        if not path.exists():
            raise NoAnswer(absent)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return daemon_socket.verified_socket(path, timeout)
            except UnsafePath as error:
                raise NoAnswer(str(error)) from None
            except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
                if time.monotonic() >= deadline:
                    raise NoAnswer(absent) from None
            time.sleep(0.05)

    def ask(self, request: Message, *, slow: str = "") -> Message:
        """The daemon's answer to ``request``. ``slow``: said on stderr once the answer is
        ``QUIET_S`` late (a command that waits says for what)."""
        request_id = next(self._request_ids)
        transport.send(self._socket, request, request_id)
        asked = time.monotonic()
        deadline = asked + self.timeout
        while (left := deadline - time.monotonic()) > 0:
            if slow and time.monotonic() - asked >= QUIET_S:
                print(slow, file=sys.stderr, flush=True)
                slow = ""
            if not self._socket.poll(int(min(left, _GONE_CHECK_S) * 1000) + 1):
                if not self.path.exists():
                    # A daemon that stops cleanly removes its socket: say so now, rather than
                    # wait out the timeout and suggest that it was killed.
                    raise NoAnswer(
                        f"the dalid daemon on {endpoint(self.path)} stopped (its socket is "
                        "gone, as after `dalid stop` or SIGTERM)"
                    )
                continue
            try:
                envelope = transport.recv(self._socket)
            except ProtocolError as error:
                raise NoAnswer(str(error)) from None
            if envelope.request_id != request_id:
                continue  # the answer to an earlier request that timed out
            if isinstance(envelope.message, Error):
                refusal = envelope.message
                if refusal.code is ErrorCode.UNKNOWN_OPERATION:
                    raise NoAnswer(
                        f"the daemon on {endpoint(self.path)} does not know {request.OP!r}: it "
                        "runs an older dalid release (restart it with this one)"
                    )
                raise NoAnswer(refusal.message)
            return envelope.message
        raise NoAnswer(
            f"no dalid daemon answered on {endpoint(self.path)} within {self.timeout:g} s. A "
            "daemon that was killed leaves its socket file behind; a busy one may answer with a "
            f"longer --timeout. `{self.start}` starts one (it replaces a dead daemon's socket)"
        )

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

    def __enter__(self) -> DaemonLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ping(path: Path, timeout: float, start: str) -> int:
    """Exit status 0 when the daemon answers."""
    try:
        with DaemonLine(path, timeout, start) as line:
            reply = line.ask(Ping())
    except NoAnswer as error:
        print(f"dalid ping: {error}", file=sys.stderr)
        return 1
    assert isinstance(reply, Pong)
    print(f"dalid daemon pid {reply.daemon_pid} answers on {endpoint(path)}")
    return 0


def stop(path: Path, timeout: float, start: str, *, end_jobs: bool = False) -> int:
    """Asks the daemon to stop (it tells its jobs why) and waits until its socket is gone;
    says what it waits for once a wait is ``QUIET_S`` long.
    ``end_jobs``: its jobs end, those that would wait for a new daemon (reconnect) too."""
    waiting = f"dalid stop: waiting (up to {timeout:g} s) for the daemon on {endpoint(path)}"
    try:
        with DaemonLine(path, timeout, start) as line:
            report = line.ask(StatusRequest(), slow=f"{waiting} to answer")
            assert isinstance(report, StatusReport)
            line.ask(Shutdown(end_jobs=end_jobs), slow=f"{waiting} to take the stop")
    except NoAnswer as error:
        print(f"dalid stop: {error}", file=sys.stderr)
        return 1
    what = f"the dalid {report.device} daemon pid {report.daemon_pid} on {endpoint(path)}"
    asked = time.monotonic()
    deadline = asked + timeout
    said = False
    while path.exists():
        now = time.monotonic()
        if not said and now - asked >= QUIET_S:
            # A daemon stops in a fraction of a second unless telling its jobs (each gets a
            # notice, which may wait up to a second to leave) or freeing them takes long.
            jobs = len(report.jobs)
            print(
                f"dalid stop: {what} was asked to stop; waiting (up to {timeout:g} s) for it to "
                + (
                    f"tell its {jobs} job(s) that it stops, free their memory and remove its socket"
                    if jobs
                    else "remove its socket"
                ),
                file=sys.stderr,
                flush=True,
            )
            said = True
        if now >= deadline:
            print(
                f"dalid stop: asked {what} to stop, and its socket is still there after "
                f"{timeout:g} s: it may still be freeing its jobs' memory (see its log)",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.05)
    jobs = len(report.jobs)
    if not jobs:
        told = "; it had no jobs"
    elif end_jobs:
        told = f"; its {jobs} job(s) were told that it was stopped, and ended"
    else:
        told = (
            f"; its {jobs} job(s) were told that it was stopped (those with reconnect=True "
            "wait for a new daemon on this socket; `dalid stop --end-jobs` ends them too)"
        )
    print(f"stopped {what}{told}")
    return 0


def reload(path: Path, timeout: float, start: str) -> int:
    """Has the daemon reload its repository; prints what it loaded and what failed."""
    try:
        with DaemonLine(path, timeout, start) as line:
            report = line.ask(ReloadRepository())
    except NoAnswer as error:
        print(f"dalid reload: {error}", file=sys.stderr)
        return 1
    assert isinstance(report, RepositoryReport)
    print(f"reloaded {report.directory}: {', '.join(report.pipelines) or 'no pipelines'}")
    for failure in report.failures:
        kept = (
            f" (still serving {', '.join(failure.kept_pipelines)} from its last good load)"
            if failure.kept_pipelines
            else ""
        )
        print(f"failed: {failure.file}: {failure.message}{kept}", file=sys.stderr)
    return EXIT_LOAD_FAILED if report.failures else 0


def _columns(value: str | None, default: int) -> int:
    """The width ``COLUMNS`` asks for, else ``default``."""
    try:
        width = int(value or "")
    except ValueError:
        return default
    return width if width > 0 else default


def status(path: Path, args: argparse.Namespace, start: str) -> int:
    """Prints the daemon's status: JSON once, a table once, or a live table until Ctrl-C.

    A daemon that its supervisor reports crash-looping (:mod:`.crash_report`) is said to be
    first, on stderr, whether or not a daemon answers now; with ``--json`` the report is also
    the object's ``crash_loop``.
    """
    from .status_view import as_json, table

    crashes = crash_report.read(path)
    if crashes is not None:
        print(f"dalid status: {crashes.text()}", file=sys.stderr)
    crash_loop = {"crash_loop": dataclasses.asdict(crashes)} if crashes is not None else {}
    try:
        with DaemonLine(path, args.timeout, start) as line:
            where = endpoint(path)
            report = line.ask(StatusRequest())
            assert isinstance(report, StatusReport)
            if args.json:
                print(as_json(report, crash_loop))
                return 0
            from rich.console import Console
            from rich.live import Live

            console = Console()
            if not console.is_terminal:
                # A pipe or a file has no width of its own: COLUMNS if set (as the shell's
                # `COLUMNS=80 dalid status --once | less`), else wide enough not to cut the table.
                console = Console(width=_columns(os.environ.get("COLUMNS"), default=200))
            if args.once or not console.is_terminal:
                console.print(table(report, where, console.width))
                return 0
            with Live(
                table(report, where, console.width), console=console, auto_refresh=False
            ) as live:
                try:
                    while True:
                        time.sleep(args.interval)
                        report = line.ask(StatusRequest())
                        assert isinstance(report, StatusReport)
                        live.update(table(report, where, console.width), refresh=True)
                except KeyboardInterrupt:
                    return 0
    except NoAnswer as error:
        print(f"dalid status: {error}", file=sys.stderr)
        if args.json and crash_loop:
            print(json.dumps(crash_loop, indent=2, sort_keys=True))
        return 1
