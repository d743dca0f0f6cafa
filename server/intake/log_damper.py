"""A log line that a flood of connections could repeat thousands of times a second, damped.

A storm of connections (5 processes reconnecting 450 connections each) once wrote 32,005 "cut
at once" lines in a few seconds, and the daemon spent its time writing them. A
:class:`DampedLog` lets ``per_second`` lines of its kind through each second and counts the
others; the next line that goes through says how many were left out, and so does
:meth:`DampedLog.flush` once the second is over, so that a storm's last lines are counted too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

# Lines of one kind logged per second at most.
LINES_PER_SECOND = 3


class DampedLog:
    """Warnings of one kind on ``log``, at most ``per_second`` a second; the rest counted."""

    def __init__(
        self,
        log: logging.Logger,
        per_second: int = LINES_PER_SECOND,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._per_second = per_second
        self._clock = clock
        self._window_start = clock()
        self._logged = 0
        # Lines left out since the last one logged, and in all.
        self.left_out = 0
        self.left_out_total = 0

    def warning(self, message: str, *args: Any) -> None:
        """Logs ``message % args`` unless ``per_second`` lines went out this second already."""
        self._roll(self._clock())
        if self._logged >= self._per_second:
            self.left_out += 1
            self.left_out_total += 1
            return
        self._logged += 1
        if self.left_out:
            message += " (and %d more like it not logged)"
            args = (*args, self.left_out)
            self.left_out = 0
        self._log.warning(message, *args, stacklevel=2)

    def flush(self) -> None:
        """Once a second is over with lines left out, logs how many: a storm's end is told."""
        now = self._clock()
        if self.left_out and now - self._window_start >= 1.0:
            self._log.warning(
                "%d more lines like the last were not logged (at most %d a second)",
                self.left_out,
                self._per_second,
            )
            self.left_out = 0
            self._window_start = now
            self._logged = 1

    def _roll(self, now: float) -> None:
        if now - self._window_start >= 1.0:
            self._window_start = now
            self._logged = 0
