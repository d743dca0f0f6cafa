"""What the supervisor tells ``dalid status`` about a daemon that keeps crashing.

While a daemon crash-loops there is mostly no daemon to answer ``dalid status``, so its
supervisor writes what it knows beside the socket, in ``<socket>.crashes``: how many crashes in
a row, how the last one ended, when the next start is due, and the daemon's last log lines.
The file lies in the socket's directory, which only the user can write to; it is written whole
(a new file renamed over the old) and never followed as a link. ``dalid status`` prints it, with
or without a daemon answering; the supervisor removes it once a daemon has run long enough to
count as started, and when it exits. A report whose supervisor is gone is not shown.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dalid.protocol import process_running


@dataclass(frozen=True)
class CrashReport:
    """A daemon crash-looping under supervisor ``supervisor_pid``."""

    name: str
    crashes: int  # in a row, each within ``within_s`` of its start
    within_s: float
    last_exit: str  # "killed by signal 9", "exited with 1"
    restart_at: float  # wall-clock time of the next start
    supervisor_pid: int
    log_lines: list[str] = field(default_factory=list)

    def text(self, now: float | None = None) -> str:
        """The report in words, for the log and ``dalid status``."""
        wait = max(0.0, self.restart_at - (time.time() if now is None else now))
        lines = [
            f"daemon {self.name} is crash-looping: {self.crashes} crashes in a row, each within "
            f"{self.within_s:.0f} s of its start; the last one {self.last_exit}. The supervisor "
            f"(pid {self.supervisor_pid}) starts it again in {wait:.1f} s, waiting longer after "
            "each crash."
        ]
        if self.log_lines:
            lines.append("Its last log lines:")
            lines += [f"  {line}" for line in self.log_lines]
        return "\n".join(lines)


def path_for(socket: Path) -> Path:
    return socket.with_name(socket.name + ".crashes")


def write(socket: Path, report: CrashReport) -> None:
    path = path_for(socket)
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump(asdict(report), file)
    os.replace(partial, path)


def read(socket: Path) -> CrashReport | None:
    """The report beside ``socket``, if one is there and its supervisor still runs."""
    try:
        fd = os.open(path_for(socket), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as file:
            report = CrashReport(**json.load(file))
    except (OSError, ValueError, TypeError):
        return None
    return report if process_running(report.supervisor_pid) else None


def remove(socket: Path) -> None:
    with contextlib.suppress(OSError):
        path_for(socket).unlink()
