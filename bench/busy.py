"""How many of the machine's cores were busy over the jobs' timed windows, from ``/proc/stat``.

On a CPU-bound machine a contender's samples/s is its busy cores over its CPU per sample. The
per-process account (:class:`bench.measure.Probe`) sees the trainers, their live workers and
the daemon; this figure sees the whole machine, so that the two side by side say whether a
slower contender left cores idle or spent CPU that the account misses (processes that ended
inside the window, kernel threads, the orchestrator's own samplers).

The orchestrator samples the machine's busy ticks (user + nice + system + irq + softirq +
steal, all cores) every :data:`INTERVAL_S` while the trainers run, stamped with
``time.monotonic_ns``, the clock the trainers stamp their batches with; the busy ticks at a
window's ends are interpolated between the samples around them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

INTERVAL_S = 0.1
_TICK = os.sysconf("SC_CLK_TCK")


def parse_cpu_line(line: str) -> tuple[int, int]:
    """Busy and all ticks of the aggregate ``cpu`` line of ``/proc/stat`` (see proc(5)): busy
    is user + nice + system + irq + softirq + steal; all adds idle and iowait. Guest time is
    already counted in user and nice."""
    name, *fields = line.split()
    if name != "cpu" or len(fields) < 8:
        raise ValueError(f"not the cpu line of /proc/stat: {line!r}")
    user, nice, system, idle, iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def read_busy_ticks() -> int:
    """The machine's busy ticks since boot, all cores together."""
    with open("/proc/stat") as stat:
        return parse_cpu_line(stat.readline())[0]


Sample = tuple[int, int]  # (time.monotonic_ns, busy ticks)


def _ticks_at(samples: Sequence[Sample], t_ns: int) -> float | None:
    """Busy ticks at ``t_ns``, linear between the samples around it; None outside them."""
    for (t0, b0), (t1, b1) in itertools.pairwise(samples):
        if t0 <= t_ns <= t1:
            return b0 + (b1 - b0) * ((t_ns - t0) / (t1 - t0) if t1 > t0 else 0.0)
    return None


def busy_cores(samples: Sequence[Sample], start_ns: int, end_ns: int) -> float | None:
    """Average busy cores of the machine from ``start_ns`` to ``end_ns``; None when the
    samples do not cover that span."""
    if end_ns <= start_ns:
        return None
    start, end = _ticks_at(samples, start_ns), _ticks_at(samples, end_ns)
    if start is None or end is None:
        return None
    return (end - start) / _TICK / ((end_ns - start_ns) / 1e9)


def timeline(samples: Sequence[Sample]) -> list[tuple[int, float]]:
    """Busy cores over each interval between two samples, stamped at its end."""
    return [
        (t1, (b1 - b0) / _TICK / ((t1 - t0) / 1e9))
        for (t0, b0), (t1, b1) in itertools.pairwise(samples)
        if t1 > t0
    ]


def window_figures(
    samples: Sequence[Sample], starts: Sequence[int], ends: Sequence[int]
) -> dict[str, Any]:
    """Busy cores over the jobs' common window (the last start to the first end) and over
    their union (the first start to the last end); None where a window is empty or the
    samples do not cover it."""
    if not starts or not ends:
        return {"common": None, "union": None}
    return {
        "common": busy_cores(samples, max(starts), min(ends)),
        "union": busy_cores(samples, min(starts), max(ends)),
    }


class BusySampler:
    """Samples the machine's busy ticks on a thread of its own while :meth:`running`."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()

    def _sample(self) -> None:
        before = time.monotonic_ns()
        ticks = read_busy_ticks()
        self.samples.append(((before + time.monotonic_ns()) // 2, ticks))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    @contextlib.contextmanager
    def running(self) -> Iterator[BusySampler]:
        """Samples from now until the block ends, one sample at each end included."""
        self._sample()
        thread = threading.Thread(target=self._loop, name="bench-busy", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()
            self._sample()
