"""A supervised child's output: passed on to the supervisor's own, its last lines kept.

When a daemon crashes, its last log lines usually say why; the supervisor repeats them in its
log and in what ``dalid status`` shows (:mod:`.crash_report`). A child that writes to the
supervisor's stdout and stderr gets a pipe for each instead; :meth:`ChildOutput.pump` copies
what arrives to the same stream of the supervisor, unchanged, and keeps the last lines. A child
that writes to a log file of its own keeps doing so, and its last lines are read from the file.
"""

from __future__ import annotations

import collections
import contextlib
import os
from pathlib import Path

KEPT_LINES = 20
_CHUNK = 65536


class ChildOutput:
    """The read ends of a child's stdout and stderr pipes. ``close()`` is idempotent."""

    def __init__(self, keep: int = KEPT_LINES) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        # read end -> (the supervisor's stream it goes to, the line not yet ended)
        self._pipes: dict[int, tuple[int, bytearray]] = {}

    def open(self) -> tuple[int, int]:
        """New pipes for a child's stdout and stderr; the caller gives the child the write ends
        and closes them in the supervisor once the child has them."""
        ends = []
        for stream in (1, 2):
            read, write = os.pipe2(os.O_CLOEXEC)
            os.set_blocking(read, False)
            self._pipes[read] = (stream, bytearray())
            ends.append(write)
        return ends[0], ends[1]

    @property
    def fds(self) -> list[int]:
        return list(self._pipes)

    def pump(self, fd: int) -> None:
        """Copies what ``fd`` holds now; closes it at end of file (the child has exited)."""
        stream, partial = self._pipes[fd]
        while True:
            try:
                data = os.read(fd, _CHUNK)
            except BlockingIOError:
                return
            if not data:
                if partial:
                    self._keep(bytes(partial))
                os.close(fd)
                del self._pipes[fd]
                return
            with contextlib.suppress(OSError):  # the supervisor's own output is gone
                os.write(stream, data)
            partial += data
            *complete, rest = partial.split(b"\n")
            for line in complete:
                self._keep(line)
            partial[:] = rest[-_CHUNK:]  # a line without end is kept to its last part

    def drain(self) -> None:
        """Copies what is left once the child has exited, and closes the pipes."""
        for fd in self.fds:
            self.pump(fd)
        self.close()

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self._pipes.clear()

    def _keep(self, line: bytes | bytearray) -> None:
        self.lines.append(line.decode(errors="replace").rstrip("\r"))


def last_lines(log: Path, count: int = KEPT_LINES) -> list[str]:
    """The last lines of a child's log file (none when it cannot be read)."""
    try:
        with log.open("rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - count * 400))
            text = file.read().decode(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-count:]
