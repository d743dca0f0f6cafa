"""A fixed CPU load beside a run (``--background-load N``): N processes that each spin on a core.

The daemon's own threads cost more per sample on a saturated machine than on a quiet one
(their code and data leave the caches between two batches, a thread that wakes waits for a
core), and more jobs saturate the machine with their own DALI decoding: a run of eight jobs
changes both at once. A load that is not dalid's, started with the run and stopped with it,
saturates the machine without adding jobs, so that one job with it, one job without, and eight
jobs tell the two apart.

Each spinner is a child process of the bench that runs a pure loop at the default priority,
without memory traffic of its own beyond its core's (a Python ``while True: pass``): the load
is cores taken, not memory bandwidth. Their CPU time is reported apart
(:attr:`bench.runner.Outcome.background_cores`, read from ``/proc`` before they are stopped);
they are waited for before the run's end, so the run's "other load"
(:class:`bench.machine.LoadMeter`) counts them as the bench's own, not as other processes'.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

_SPIN = "while True:\n    pass\n"
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class BackgroundLoad:
    """The spinners of one run and the CPU they used; ``cores`` is their mean over the run."""

    count: int
    cores: float = 0.0
    _processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @contextlib.contextmanager
    def running(self) -> Iterator[BackgroundLoad]:
        """Starts ``count`` spinners, yields, then stops and waits for every one of them."""
        if self.count <= 0:
            yield self
            return
        started = time.monotonic()
        try:
            for _ in range(self.count):
                self._processes.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _SPIN],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
            yield self
        finally:
            used = sum(_process_cpu_s(process.pid) for process in self._processes)
            for process in self._processes:
                process.kill()
            for process in self._processes:
                process.wait()
            self._processes.clear()
            wall = time.monotonic() - started
            self.cores = used / wall if wall > 0 else 0.0


def _process_cpu_s(pid: int) -> float:
    """CPU seconds a live process has used (``/proc/<pid>/stat``'s utime and stime); 0 if it
    is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return 0.0
    fields = text[text.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK
