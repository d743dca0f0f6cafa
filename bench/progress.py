"""A plain-text progress bar on stderr: redrawn in place on a terminal, one line per step else."""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30


class Progress:
    def __init__(self, total: int, stream: TextIO = sys.stderr) -> None:
        self.total = total
        self.done = 0
        self.stream = stream
        self.started = time.monotonic()
        self.tty = stream.isatty()

    def _line(self, text: str) -> str:
        filled = round(WIDTH * self.done / max(1, self.total))
        elapsed = int(time.monotonic() - self.started)
        bar = "#" * filled + "-" * (WIDTH - filled)
        return f"[{bar}] {self.done}/{self.total} {elapsed // 60}:{elapsed % 60:02d} {text}"

    def start(self, text: str) -> None:
        """Shows the step now under way."""
        if self.tty:
            self.stream.write("\r\033[K" + self._line(text))
            self.stream.flush()

    def finish(self, text: str) -> None:
        """Counts a step as done and shows how it went."""
        self.done += 1
        if self.tty:
            self.stream.write(
                "\r\033[K" + self._line(text) + ("\n" if self.done == self.total else "")
            )
        else:
            self.stream.write(self._line(text) + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A message on a line of its own, above the bar."""
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()
