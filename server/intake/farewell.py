"""What a daemon stopped on purpose tells the peers connected to it before it goes.

A daemon that is stopped (``dalid stop``, SIGTERM or SIGINT) is not restarted by its
supervisor, and its jobs end. Each connected peer, trainers and DataLoader workers alike, gets
one ``error`` push with code ``shutting_down`` that says so, so that a client tells its user
"the daemon was stopped" rather than guessing at a crash, and a job with ``reconnect=True``
gives up at once instead of waiting for a daemon that nobody will restart. A daemon that
crashes or is killed says nothing; its clients notice it gone as before.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from dalid.protocol import Error, ErrorCode, endpoint

# How long closing the socket may wait for the notices to leave (ZeroMQ's linger).
NOTICE_LINGER_MS = 1000


def stop_reason(signum: int | None) -> str:
    """Why the daemon stops, as the notice and the log say it."""
    if signum is None:
        return "`dalid stop` asked it to"
    return f"it received {signal.Signals(signum).name}"


def stopping_notice(socket: Path, reason: str) -> Error:
    """The push every peer gets from a daemon stopped on purpose."""
    return Error(
        ErrorCode.SHUTTING_DOWN,
        f"the dalid daemon on {endpoint(socket)} (pid {os.getpid()}) was stopped ({reason}) "
        "and ended this job; it will not be restarted by itself",
    )
