"""How a daemon stops: why (:class:`Stop`), what it tells its peers, and how long it may take.

A daemon stops on SIGTERM or SIGINT (a service manager's stop, the first half of an upgrade),
on ``dalid stop``, or on SIGTERM because its supervisor died (``PR_SET_PDEATHSIG``). It stops
reading its socket at once (no new batch is taken), and each connected peer, trainers and
DataLoader workers alike, gets one ``error`` push with code ``shutting_down`` that says why:
batches in flight are handed back, since every trainer submits again what it had not
delivered. The notice tells a job *why* the daemon went, not whether to give up: a job with
``reconnect=True`` waits for the next daemon on the socket (Note [Daemon restarts],
docs/design/daemon-restarts.md). Only ``dalid stop --end-jobs`` ends every job: its notice says
``ends_jobs``. A daemon that crashes or is killed says nothing; its clients notice it gone.

A stop is bounded: a daemon that has not exited ``STOP_BOUND_S`` after it was asked to (a
pipeline stuck in a read, say) removes what a clean stop would and exits at once
(:func:`bound_the_stop`), so a service manager's grace period (Kubernetes'
``terminationGracePeriodSeconds``) never has to kill it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from dalid.protocol import Error, ErrorCode, endpoint

log = logging.getLogger("dalid.server")

# How long closing the socket may wait for the notices to leave (ZeroMQ's linger).
NOTICE_LINGER_MS = 1000
# The most a stop may take from the request to the exit (docs/deployment.md, Upgrades).
STOP_BOUND_S = 10.0


class StopKind(Enum):
    """Why a daemon stops."""

    SIGNAL = "signal"  # SIGTERM or SIGINT: a service manager's stop, or an upgrade
    REQUEST = "request"  # `dalid stop`
    END_JOBS = "end_jobs"  # `dalid stop --end-jobs`: its jobs end with it
    SUPERVISOR_GONE = "supervisor_gone"  # its supervisor died (SIGTERM by PR_SET_PDEATHSIG)


@dataclass(frozen=True)
class Stop:
    """A daemon's stop: its kind, the signal that asked for it and the supervisor that died."""

    kind: StopKind
    signum: int | None = None
    supervisor: int | None = None

    @staticmethod
    def from_signal(signum: int, supervisor: int | None) -> Stop:
        """The stop that signal ``signum`` asks for, in a daemon run by ``supervisor`` (None:
        unsupervised): the supervisor's death when this process has another parent now."""
        if supervisor is not None and os.getppid() != supervisor:
            return Stop(StopKind.SUPERVISOR_GONE, signum, supervisor)
        return Stop(StopKind.SIGNAL, signum)

    @property
    def reason(self) -> str:
        """Why the daemon stops, as the notice and the log say it."""
        if self.kind is StopKind.SUPERVISOR_GONE:
            return f"its supervisor `dalid serve` (pid {self.supervisor}) died"
        if self.kind is StopKind.REQUEST:
            return "`dalid stop` asked it to"
        if self.kind is StopKind.END_JOBS:
            return "`dalid stop --end-jobs` asked it to, ending its jobs"
        assert self.signum is not None
        return f"it received {signal.Signals(self.signum).name}"

    def notice(self, socket: Path) -> Error:
        """The push every peer gets from the stopping daemon."""
        return Error(
            ErrorCode.SHUTTING_DOWN,
            f"the dalid daemon on {endpoint(socket)} (pid {os.getpid()}) was stopped "
            f"({self.reason})",
            ends_jobs=self.kind is StopKind.END_JOBS,
        )


def bound_the_stop(
    abandon: Callable[[], None],
    asked: threading.Event,
    stopped: threading.Event,
    bound_s: float = STOP_BOUND_S,
) -> None:
    """Exits the process ``bound_s`` after ``asked`` is set unless ``stopped`` is set by then,
    after ``abandon`` (which removes the socket's files and the daemon's shared memory). The
    thread ends at once when ``stopped`` is set with ``asked`` (a clean stop, or a close)."""

    def overrun() -> None:
        asked.wait()
        if stopped.wait(bound_s):
            return
        log.error("not stopped %.0f s after it was asked to: exiting now", bound_s)
        try:
            abandon()
        finally:
            # What a stop leaves is gone: a supervisor must not restart it, as after any stop.
            os._exit(0)

    threading.Thread(target=overrun, name="dalid-stop-bound", daemon=True).start()
