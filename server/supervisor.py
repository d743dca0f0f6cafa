"""``dalid serve``'s supervisor: each daemon runs in a child process, restarted when it crashes.

Some CUDA errors (an illegal memory access, say) leave the process's context unusable until the
process exits, so a daemon that meets one must be replaced by a new process. The supervisor is
that small parent: it holds no CUDA context, socket or shared memory, only its children, one per
device (``--devices 0,1`` runs one daemon per GPU, each with its own CUDA context, socket and
log). It

- restarts a child that crashed (killed by a signal, or a non-zero exit), after a delay that
  doubles with each fast crash in a row, and gives up on a child after ``max_fast_crashes``;
- leaves stopped a child that exited cleanly (``dalid stop``, ``--idle-timeout``) or that
  cannot start (another daemon holds its socket, no such GPU): a restart would not help;
- forwards SIGTERM and SIGINT to its children, waits for them, and exits with their status
  (0 when every child stopped cleanly);
- forwards SIGHUP to its running children, each of which then reloads its pipeline repository
  (a child starts with SIGHUP ignored until it can reload, and loads the directory afresh at
  start anyway);
- exits once no child is left running or waiting for a restart.

Children die with the supervisor (``PR_SET_PDEATHSIG``), so a killed supervisor leaves no
daemon behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from dalid.protocol import (
    SOCKET_ENV,
    Device,
    GpuUnavailable,
    device_label,
    parse_device,
    runtime_dir,
    socket_path,
)

from .daemon import EXIT_ALREADY_RUNNING, EXIT_NO_DEVICE

log = logging.getLogger("dalid.supervisor")

# Exit statuses of a daemon that a restart cannot fix (its own, and argparse's).
EXIT_USAGE = 2
NOT_RESTARTED = frozenset({EXIT_USAGE, EXIT_ALREADY_RUNNING, EXIT_NO_DEVICE})
STOP_GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildSpec:
    """One daemon to run: its name in logs, its command line, and its log file (None:
    the supervisor's own stdout and stderr)."""

    name: str
    command: tuple[str, ...]
    log: Path | None = None


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a crashed child. A crash less than ``fast_crash_s`` after its start is
    a fast crash; after ``max_fast_crashes`` of them in a row the child is given up."""

    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    fast_crash_s: float = 30.0
    max_fast_crashes: int = 5

    def delay(self, fast_crashes: int) -> float:
        return min(self.max_delay_s, self.first_delay_s * 2 ** max(0, fast_crashes - 1))


class State(Enum):
    RUNNING = "running"
    WAITING = "waiting"  # crashed, restarting at ``restart_at``
    DONE = "done"


@dataclass
class Child:
    spec: ChildSpec
    state: State = State.WAITING
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float = 0.0
    fast_crashes: int = 0
    restarts: int = 0
    exit_status: int = 0
    pids: list[int] = field(default_factory=list)


def exit_status(returncode: int) -> int:
    """A child's return code as a shell reports it (128 + N for a child killed by signal N)."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """Runs ``specs`` as children until all have stopped; see the module docstring."""

    def __init__(self, specs: Sequence[ChildSpec], policy: RestartPolicy | None = None) -> None:
        if not specs:
            raise ValueError("nothing to supervise")
        self.children = [Child(spec) for spec in specs]
        self.policy = policy or RestartPolicy()
        self._stop_signal: int | None = None
        self._reload_requested = False
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def request_stop(self, signum: int, _frame: Any = None) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"\0")

    def request_reload(self, _signum: int, _frame: Any = None) -> None:
        self._reload_requested = True
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"\0")

    def run(self) -> int:
        """Supervises in the calling (main) thread; returns the exit status."""
        previous = {
            signum: signal.signal(signum, self.request_stop)
            for signum in (signal.SIGTERM, signal.SIGINT)
        }
        # A child's exit wakes the loop at once rather than at its next poll.
        previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, self._on_child_exit)
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self.request_reload)
        try:
            log.info("dalid supervisor pid %d starting %d daemon(s)", os.getpid(), len(self))
            for child in self.children:
                self._start(child)
            while self._stop_signal is None and self._step():
                if self._reload_requested:
                    self._reload_requested = False
                    self._forward_reload()
                self._sleep(self._next_wake())
            if self._stop_signal is not None:
                self._stop_all(self._stop_signal)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            os.close(self._wake_read)
            os.close(self._wake_write)
        status = next((c.exit_status for c in self.children if c.exit_status), 0)
        log.info("dalid supervisor pid %d exits with %d", os.getpid(), status)
        return status

    def __len__(self) -> int:
        return len(self.children)

    # --- one round ------------------------------------------------------------------------------

    def _step(self) -> bool:
        """Reaps exited children and starts those due; whether any child is left."""
        now = time.monotonic()
        for child in self.children:
            if child.state is State.RUNNING:
                assert child.process is not None
                code = child.process.poll()
                if code is not None:
                    self._exited(child, code, now)
            if child.state is State.WAITING and now >= child.restart_at:
                self._start(child)
        return any(child.state is not State.DONE for child in self.children)

    def _exited(self, child: Child, returncode: int, now: float) -> None:
        status = exit_status(returncode)
        child.exit_status = status
        name = child.spec.name
        if returncode == 0:
            log.info("daemon %s (pid %d) stopped", name, child.pids[-1])
            child.state = State.DONE
            return
        if returncode in NOT_RESTARTED:
            log.error("daemon %s exited with %d, which a restart cannot fix", name, status)
            child.state = State.DONE
            return
        fast = now - child.started_at < self.policy.fast_crash_s
        child.fast_crashes = child.fast_crashes + 1 if fast else 1
        if child.fast_crashes > self.policy.max_fast_crashes:
            log.error(
                "daemon %s crashed %d times in a row, each within %.0f s of its start (restarted "
                "%d times): giving up. The lines above say why; fix that and run `dalid serve` "
                "again",
                name,
                child.fast_crashes,
                self.policy.fast_crash_s,
                self.policy.max_fast_crashes,
            )
            child.state = State.DONE
            return
        delay = self.policy.delay(child.fast_crashes)
        how = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with {status}"
        log.warning("daemon %s (pid %d) %s: restarting in %.1f s", name, child.pids[-1], how, delay)
        child.state = State.WAITING
        child.restart_at = now + delay

    def _start(self, child: Child) -> None:
        spec = child.spec
        parent = os.getpid()

        def before_exec() -> None:
            # Ignored until the daemon handles it: SIGHUP's default would end a daemon that is
            # still starting. An ignored signal stays ignored across exec.
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the supervisor died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)

        output = None
        if spec.log is not None:
            output = spec.log.open("ab")
        try:
            child.process = subprocess.Popen(
                spec.command,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                preexec_fn=before_exec,  # noqa: PLW1509 - the supervisor has one thread
            )
        finally:
            if output is not None:
                output.close()
        if child.pids:
            child.restarts += 1
        child.pids.append(child.process.pid)
        child.state = State.RUNNING
        child.started_at = time.monotonic()
        where = f", log {spec.log}" if spec.log is not None else ""
        log.info("daemon %s started as pid %d%s", spec.name, child.process.pid, where)

    def _forward_reload(self) -> None:
        running = [c for c in self.children if c.state is State.RUNNING]
        log.info("SIGHUP: %d daemon(s) reload their pipeline repository", len(running))
        for child in running:
            assert child.process is not None
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGHUP)

    # --- stopping and waiting -------------------------------------------------------------------

    def _stop_all(self, signum: int) -> None:
        log.info("signal %d: stopping %d daemon(s)", signum, len(self))
        running = [c for c in self.children if c.state is State.RUNNING]
        for child in running:
            assert child.process is not None
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signum)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in running:
            assert child.process is not None
            try:
                code = child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error(
                    "daemon %s did not stop in %.0f s: killing it", child.spec.name, STOP_GRACE_S
                )
                child.process.kill()
                code = child.process.wait()
            # A daemon stopped by the signal it was sent stopped cleanly.
            child.exit_status = 0 if code in (0, -signum) else exit_status(code)
        for child in self.children:
            child.state = State.DONE

    def _next_wake(self) -> float:
        waiting = [c.restart_at for c in self.children if c.state is State.WAITING]
        until_restart = min(waiting) - time.monotonic() if waiting else 1.0
        return max(0.0, min(1.0, until_restart))

    def _on_child_exit(self, _signum: int, _frame: Any) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"\0")

    def _sleep(self, timeout: float) -> None:
        ready, _, _ = select.select([self._wake_read], [], [], timeout)
        if ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_read, 4096)


# --- what to supervise ------------------------------------------------------------------------


class DeviceListError(ValueError):
    """A ``--devices`` value that names no device, or devices this machine lacks."""


def parse_devices(text: str, gpu_count: Callable[[], int]) -> list[Device]:
    """``--devices``: ``all`` (every GPU that ``gpu_count()`` reports), or a comma-separated
    list of ``cpu`` and GPU ordinals such as ``0,1``."""
    text = text.strip().lower()
    if text == "all":
        try:
            count = gpu_count()
        except GpuUnavailable as error:
            raise DeviceListError(
                f"--devices all: this machine has no usable GPU ({error}); use --devices cpu "
                "for CPU pipelines"
            ) from None
        if count == 0:
            raise DeviceListError(
                "--devices all: the CUDA driver reports no GPU (check CUDA_VISIBLE_DEVICES); "
                "use --devices cpu for CPU pipelines"
            )
        return list(range(count))
    devices: list[Device] = []
    for item in text.split(","):
        try:
            device = parse_device(item)
        except ValueError as error:
            raise DeviceListError(f"--devices {text!r}: {error}") from None
        if device in devices:
            raise DeviceListError(f"--devices {text!r} names {device_label(device)} twice")
        devices.append(device)
    return devices


def child_specs(
    devices: Sequence[Device], socket: str | None, daemon_options: Sequence[str]
) -> list[ChildSpec]:
    """One child per device. A single daemon logs to the supervisor's output and may take
    ``socket``; several each get ``<runtime dir>/<device>.sock`` and a log file beside it."""
    if len(devices) == 1:
        device = devices[0]
        path = socket_path(device, socket)
        return [ChildSpec(device_label(device), _daemon_command(device, path, daemon_options))]
    if socket is not None or os.environ.get(SOCKET_ENV):
        raise DeviceListError(
            f"several devices need a socket each: drop --socket and ${SOCKET_ENV}; each daemon "
            "listens on <runtime dir>/<device>.sock"
        )
    directory = runtime_dir()
    specs = []
    for device in devices:
        label = device_label(device)
        path = directory / f"{label}.sock"
        command = _daemon_command(device, path, daemon_options)
        specs.append(ChildSpec(label, command, path.with_name(path.name + ".log")))
    return specs


def _daemon_command(device: Device, socket: Path, options: Sequence[str]) -> tuple[str, ...]:
    return (
        sys.executable, "-m", "dalid.server", "serve", "--no-supervisor",
        "--device", str(device), "--socket", str(socket), *options,
    )  # fmt: skip
