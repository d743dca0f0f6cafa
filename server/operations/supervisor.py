"""``dalid serve``'s supervisor: each daemon runs in a child process, restarted when it crashes.

Some CUDA errors (an illegal memory access, say) leave the process's context unusable until the
process exits, so a daemon that meets one must be replaced by a new process. The supervisor is
that small parent: it holds no CUDA context, socket or shared memory, only its children, one per
device (``--devices 0,1`` runs one daemon per GPU, each with its own CUDA context, socket and
log). It

- restarts a child that crashed (killed by a signal, or a non-zero exit), after a delay that
  doubles with each fast crash in a row, up to a cap, less a random part (so that daemons
  crashing together do not restart together). It never gives up: a daemon that an OOM killer
  keeps killing comes back once memory is there, and jobs with ``reconnect=True`` carry on.
  After ``crash_loop_after`` fast crashes in a row it says, in its log and in what
  ``dalid status`` shows (:mod:`.crash_report`), that the daemon is crash-looping and why: the
  last exit status and the child's last log lines (:mod:`.child_output`);
- leaves stopped a child that exited cleanly (``dalid stop``, ``--idle-timeout``) or that
  cannot start (another daemon holds its socket, no such GPU): a restart would not help;
- forwards SIGTERM and SIGINT to its children, waits for them, and exits with their status
  (0 when every child stopped cleanly);
- forwards SIGHUP to its running children, each of which then reloads its pipeline repository
  (a child starts with SIGHUP ignored until it can reload, and loads the directory afresh at
  start anyway);
- exits once no child is left running or waiting for a restart.

Children die with the supervisor (``PR_SET_PDEATHSIG``, and :mod:`.lifeline` for a child
too stuck to stop), so a killed supervisor leaves no daemon behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import select
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ..intake.daemon import EXIT_ALREADY_RUNNING, EXIT_NO_DEVICE, EXIT_UNSAFE_PATH
from . import crash_report
from .child_output import ChildOutput, last_lines
from .crash_report import CrashReport
from .lifeline import SUPERVISOR_ENV

log = logging.getLogger("dalid.supervisor")

# Exit statuses of a daemon that a restart cannot fix (its own, and argparse's).
EXIT_USAGE = 2
NOT_RESTARTED = frozenset({EXIT_USAGE, EXIT_ALREADY_RUNNING, EXIT_NO_DEVICE, EXIT_UNSAFE_PATH})
STOP_GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildSpec:
    """One daemon to run: its name in logs, its command line, its log file (None: the
    supervisor's own stdout and stderr), and its socket (where a crash report goes)."""

    name: str
    command: tuple[str, ...]
    log: Path | None = None
    socket: Path | None = None


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a crashed child. A crash less than ``fast_crash_s`` after its start is
    a fast crash; the delay doubles with each one in a row, up to ``max_delay_s``, less up to
    ``jitter`` of it at random. From ``crash_loop_after`` of them in a row the child is
    crash-looping; once it has run ``fast_crash_s`` it no longer is."""

    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    fast_crash_s: float = 30.0
    crash_loop_after: int = 3
    jitter: float = 0.25

    def delay(self, fast_crashes: int, rng: random.Random | None = None) -> float:
        ceiling = min(self.max_delay_s, self.first_delay_s * 2.0 ** max(0, fast_crashes - 1))
        draw = rng.random() if rng is not None else random.random()
        return ceiling * (1.0 - self.jitter * draw)


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
    # The child's stdout and stderr when they pass through the supervisor (no log file).
    output: ChildOutput | None = None
    # The crash report in force while it crash-loops (see crash_report).
    report: CrashReport | None = None


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
            for child in self.children:
                if child.output is not None:
                    child.output.close()
                self._clear_report(child)
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
                elif child.fast_crashes and now - child.started_at >= self.policy.fast_crash_s:
                    if child.report is not None:
                        log.info("daemon %s has run %.0f s: no longer crash-looping",
                                 child.spec.name, now - child.started_at)  # fmt: skip
                    child.fast_crashes = 0
                    self._clear_report(child)
            if child.state is State.WAITING and now >= child.restart_at:
                self._start(child)
        return any(child.state is not State.DONE for child in self.children)

    def _exited(self, child: Child, returncode: int, now: float) -> None:
        status = exit_status(returncode)
        child.exit_status = status
        if child.output is not None:
            child.output.drain()
        name = child.spec.name
        if returncode == 0:
            log.info("daemon %s (pid %d) stopped", name, child.pids[-1])
            child.state = State.DONE
            self._clear_report(child)
            return
        if returncode in NOT_RESTARTED:
            log.error("daemon %s exited with %d, which a restart cannot fix", name, status)
            child.state = State.DONE
            self._clear_report(child)
            return
        fast = now - child.started_at < self.policy.fast_crash_s
        child.fast_crashes = child.fast_crashes + 1 if fast else 1
        delay = self.policy.delay(child.fast_crashes)
        how = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with {status}"
        log.warning("daemon %s (pid %d) %s: restarting in %.1f s", name, child.pids[-1], how, delay)
        child.state = State.WAITING
        child.restart_at = now + delay
        if child.fast_crashes >= self.policy.crash_loop_after:
            self._report_crash_loop(child, how, delay)

    def _report_crash_loop(self, child: Child, how: str, delay: float) -> None:
        """Says in the log, and beside the socket for ``dalid status``, that ``child`` keeps
        crashing, how it last ended and what it last said."""
        if child.output is not None:
            lines = list(child.output.lines)
        else:
            lines = last_lines(child.spec.log) if child.spec.log is not None else []
        child.report = CrashReport(
            name=child.spec.name,
            crashes=child.fast_crashes,
            within_s=self.policy.fast_crash_s,
            last_exit=how,
            restart_at=time.time() + delay,
            supervisor_pid=os.getpid(),
            log_lines=lines,
        )
        log.error("%s", child.report.text())
        if child.spec.socket is not None:
            try:
                crash_report.write(child.spec.socket, child.report)
            except OSError as error:
                log.warning("cannot write the crash report beside %s: %s", child.spec.socket, error)

    def _clear_report(self, child: Child) -> None:
        if child.report is not None and child.spec.socket is not None:
            crash_report.remove(child.spec.socket)
        child.report = None

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

        # A log file of its own, or pipes through this process (to keep its last lines).
        stdout: Any
        stderr: Any
        if spec.log is not None:
            stdout, stderr = spec.log.open("ab"), subprocess.STDOUT
        else:
            if child.output is None:
                child.output = ChildOutput()
            stdout, stderr = child.output.open()
        try:
            child.process = subprocess.Popen(
                spec.command,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                env={**os.environ, SUPERVISOR_ENV: str(parent)},
                preexec_fn=before_exec,  # noqa: PLW1509 - the supervisor has one thread
            )
        finally:
            # The child has its ends (or never will): this process keeps the read ends only.
            if spec.log is not None:
                stdout.close()
            else:
                os.close(stdout)
                os.close(stderr)
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
        # Their output keeps flowing while they stop: a child blocked on a full pipe would not.
        deadline = time.monotonic() + STOP_GRACE_S
        while any(c.process.poll() is None for c in running if c.process is not None):
            if time.monotonic() >= deadline:
                break
            self._sleep(0.1)
        for child in running:
            assert child.process is not None
            code = child.process.poll()
            if code is None:
                log.error(
                    "daemon %s did not stop in %.0f s: killing it", child.spec.name, STOP_GRACE_S
                )
                child.process.kill()
                code = child.process.wait()
            if child.output is not None:
                child.output.drain()
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
        """Waits for a wake-up or ``timeout``, passing on the children's output meanwhile."""
        outputs = {
            fd: c.output for c in self.children if c.output is not None for fd in c.output.fds
        }
        ready, _, _ = select.select([self._wake_read, *outputs], [], [], timeout)
        for fd in ready:
            if fd == self._wake_read:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_read, 4096)
            else:
                outputs[fd].pump(fd)
