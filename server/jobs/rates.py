"""A job's deliveries: batches and samples in all, and their rates over the last few seconds
(``dalid status`` and the metrics endpoint show them: ``status.py``)."""

from __future__ import annotations

import collections
import threading
import time

# Rates are averaged over this many seconds: long enough to smooth batch-sized steps, short
# enough that a live table follows a job that slows down.
RATE_WINDOW_S = 5.0


class RateMeter:
    """Batches and samples delivered: totals, and rates over the last ``window`` seconds.

    Executor threads add; the daemon's I/O thread reads.
    """

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self.batches = 0
        self.samples = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        self._since = time.monotonic()

    def add(self, samples: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.batches += 1
            self.samples += samples
            self._recent.append((now, samples))
            self._forget_before(now - self.window)

    def rates(self, now: float | None = None) -> tuple[float, float]:
        """Batches and samples per second over the window (or since the meter started)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._forget_before(now - self.window)
            span = min(self.window, now - self._since)
            if span <= 0 or not self._recent:
                return 0.0, 0.0
            samples = sum(count for _, count in self._recent)
            return len(self._recent) / span, samples / span

    def _forget_before(self, cutoff: float) -> None:
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()
