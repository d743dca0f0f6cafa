"""How many of the machine's cores were busy over the jobs' timed windows, from ``/proc/stat``.

On a CPU-bound machine a contender's samples/s is its busy cores over its CPU per sample. The
per-process account (:class:`bench.measure.Probe`) sees the trainers, their live workers and
the daemon; this figure sees the whole machine, so that the two side by side say whether a
slower contender left cores idle or spent CPU that the account misses (processes that ended
inside the window, kernel threads, the orchestrator's own samplers).

The orchestrator samples the machine's busy ticks (user + nice + system + irq + softirq +
steal, all cores) every :data:`INTERVAL_S` while the trainers run, stamped with
``time.monotonic_ns``, the clock the trainers stamp their batches with; the busy ticks at a
window's ends are interpolated between the samples around them. Every
:data:`KERNEL_EVERY` samples it also reads the CPU of the kernel's own threads (children of
``kthreadd``: reclaim, compaction, memory monitors such as ``kdamond``), which no process of
the bench owns, so that the report can show what of the machine's busy cores they took.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

INTERVAL_S = 0.1
KERNEL_EVERY = 10  # samples between two readings of the kernel threads (about 1 ms each)
_TICK = os.sysconf("SC_CLK_TCK")
_PROC = Path("/proc")
_KTHREADD = 2


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


def _stat_fields(pid: str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name; None if it is gone."""
    try:
        text = (_PROC / pid / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def kernel_threads() -> list[str]:
    """The pids of the kernel's threads now: kthreadd and its children."""
    found = []
    for name in os.listdir(_PROC):
        if name.isdigit():
            fields = _stat_fields(name)
            if fields is not None and (int(name) == _KTHREADD or int(fields[1]) == _KTHREADD):
                found.append(name)
    return found


class KernelTicks:
    """The CPU ticks the kernel's threads have used since it was made: each thread's growth
    summed, so that a worker thread that exits takes none of the total with it (threads
    the kernel starts later are not counted: they are short-lived workers)."""

    def __init__(self) -> None:
        self._last = {pid: self._ticks(pid) or 0 for pid in kernel_threads()}
        self.total = 0

    @staticmethod
    def _ticks(pid: str) -> int | None:
        fields = _stat_fields(pid)
        return None if fields is None else int(fields[11]) + int(fields[12])

    def read(self) -> int:
        for pid, last in list(self._last.items()):
            ticks = self._ticks(pid)
            if ticks is None:
                del self._last[pid]
            else:
                self.total += max(0, ticks - last)
                self._last[pid] = ticks
        return self.total


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
    samples: Sequence[Sample],
    starts: Sequence[int],
    ends: Sequence[int],
    kernel: Sequence[Sample] = (),
) -> dict[str, Any]:
    """Busy cores over the jobs' common window (the last start to the first end) and over
    their union (the first start to the last end), and the kernel threads' cores over the
    common window (``kernel``: their ticks); None where a window is empty or the samples do
    not cover it."""
    if not starts or not ends:
        return {"common": None, "union": None, "kernel_threads": None}
    return {
        "common": busy_cores(samples, max(starts), min(ends)),
        "union": busy_cores(samples, min(starts), max(ends)),
        "kernel_threads": busy_cores(kernel, max(starts), min(ends)),
    }


class BusySampler:
    """Samples the machine's busy ticks on a thread of its own while :meth:`running`."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self.kernel: list[Sample] = []  # the kernel threads' ticks (KernelTicks)
        self._kernel_ticks: KernelTicks | None = None
        self._stop = threading.Event()

    def _sample(self) -> None:
        before = time.monotonic_ns()
        ticks = read_busy_ticks()
        self.samples.append(((before + time.monotonic_ns()) // 2, ticks))

    def _sample_kernel(self) -> None:
        if self._kernel_ticks is None:
            self._kernel_ticks = KernelTicks()
        before = time.monotonic_ns()
        ticks = self._kernel_ticks.read()
        self.kernel.append(((before + time.monotonic_ns()) // 2, ticks))

    def _loop(self) -> None:
        count = 0
        while not self._stop.wait(self.interval_s):
            self._sample()
            count += 1
            if count % KERNEL_EVERY == 0:
                self._sample_kernel()

    @contextlib.contextmanager
    def running(self) -> Iterator[BusySampler]:
        """Samples from now until the block ends, one sample at each end included."""
        self._sample_kernel()
        self._sample()
        thread = threading.Thread(target=self._loop, name="bench-busy", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()
            self._sample()
            self._sample_kernel()
