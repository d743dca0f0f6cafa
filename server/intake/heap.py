"""The daemon's C heap: how many arenas glibc may make, and giving freed memory back.

glibc's allocator keeps what a program frees for its next allocations, per thread arena, and
raises its threshold for mapping large blocks apart once such a block is freed: after a client
has sent many large messages, the freed frames stay in the daemon's heap. The daemon asks glibc
to return them once a job ends (``malloc_trim``), so that memory a job's traffic took goes back
when the job does.

Arenas: glibc gives each new thread that allocates an arena of its own (up to 8 per core), and
memory freed into an arena stays there for that arena's next allocations. DALI's executor and
thread pool allocate a run's buffers in some threads and free them in others, so each arena
ends up holding its own high-water mark of freed buffers: the daemon's resident memory grows
with its threads, not with what its pipelines hold. Measured on the CPU bench pipeline
(decode, random-resized crop, normalize; 128 samples a run, 2 DALI threads): peak RSS 531 MiB
with glibc's default, 497 with 4 arenas, 460 with 2 and 416 with 1, at the same throughput
(small allocations go through each thread's tcache, which takes no lock). The limit
(``mallopt(M_ARENA_MAX)``) is set before the daemon makes any thread, since arenas once made
are kept.

Free memory is given back while jobs run too (:class:`HeapKeeper`): freed memory stays resident
in the arena for its next allocations, and a pipeline whose runs vary in size (shared runs of
one to four jobs' batches) frees and allocates its buffers at shifting places, so that the
arena's resident free pages grow run after run (a 6-job soak: 38 MiB a minute, glibc's count
of memory in use flat). ``malloc_trim`` returns those pages (``madvise``) wherever they are;
the keeper calls it once the process's anonymous resident memory has grown ``growth`` past its
ceiling, the most it held in the ``interval_s`` after the last trim (what the runs take back
after a trim, their working set, is not growth): at most one trim a ``interval_s``, and
rarely more than one every few minutes; what a run re-touches after one costs a page fault a
page, a few milliseconds a trim.

DALI's host buffers: the daemon has DALI take them from malloc (``DALI_MALLOC_POOL_THRESHOLD=0``;
DALI's own pool keeps its blocks for the life of the process), so that a trim gives them back
once freed, and on a CPU daemon, whose pipelines run on DALI's legacy executor, keep each at its
largest (``DALI_HOST_BUFFER_SHRINK_THRESHOLD=0``), so that the runs reuse them:
Note [DALI's host buffers] in ``pipelines/runner.py``.

Elsewhere than glibc (musl has no arenas) all of this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger("dalid.server")

M_ARENA_MAX = -8  # glibc's malloc.h
DEFAULT_ARENAS = 1
# HeapKeeper's defaults: growth of anonymous resident memory that asks for a trim, and the
# shortest time between two trims.
TRIM_GROWTH_BYTES = 32 << 20
TRIM_INTERVAL_S = 30.0
_PAGE = os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    # Here: `dalid stop` and the other commands read this module's defaults, not libc.
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    libc = _libc()
    if libc is None:
        return None
    try:
        trim = libc.malloc_trim
    except AttributeError:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def give_back_free_memory() -> None:
    """Returns the free memory of every heap arena to the system (glibc only)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


DALI_POOL_ENV = "DALI_MALLOC_POOL_THRESHOLD"


def host_buffers_from_malloc() -> None:
    """Has DALI take its host buffers from malloc, with no pool of its own (see the module's
    docstring), unless ``DALI_MALLOC_POOL_THRESHOLD`` says otherwise. Before DALI allocates."""
    os.environ.setdefault(DALI_POOL_ENV, "0")


DALI_SHRINK_ENV = "DALI_HOST_BUFFER_SHRINK_THRESHOLD"


def host_buffers_kept() -> None:
    """Has DALI keep each host buffer at the largest size it held, never shrinking it, unless
    ``DALI_HOST_BUFFER_SHRINK_THRESHOLD`` says otherwise. Before DALI allocates.

    For the legacy executor's buffers, which the runs reuse: by default DALI shrinks a buffer
    a run fills below half, and a run of one batch after one of four then frees it, and the
    next large run maps it anew and faults in every page (docs/design/host-buffers.md)."""
    os.environ.setdefault(DALI_SHRINK_ENV, "0")


def limit_malloc_arenas(arenas: int) -> bool:
    """Caps glibc's malloc arenas at ``arenas`` (0: leave glibc's default); whether it did."""
    if arenas <= 0:
        return False
    libc = _libc()
    if libc is None:
        return False
    try:
        mallopt = libc.mallopt
    except AttributeError:
        return False  # not glibc
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if mallopt(M_ARENA_MAX, arenas) != 1:
        log.warning("could not limit malloc arenas to %d; memory use may grow with threads", arenas)
        return False
    return True


def anonymous_resident_bytes() -> int | None:
    """This process's anonymous resident memory (``RssAnon``: resident less file-backed and
    shared), from ``/proc/self/statm``; None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            fields = statm.read().split()
    except OSError:
        return None
    return (int(fields[1]) - int(fields[2])) * _PAGE


class HeapKeeper:
    """Gives the heap's free memory back when anonymous resident memory has grown ``growth``
    bytes over its ceiling: the most it held in the ``interval_s`` after the last trim, once
    the runs had taken back what they use (see the module's docstring). Never twice within
    ``interval_s``. Used by the daemon's I/O thread alone."""

    def __init__(
        self,
        growth: int = TRIM_GROWTH_BYTES,
        interval_s: float = TRIM_INTERVAL_S,
        *,
        resident: Callable[[], int | None] = anonymous_resident_bytes,
        trim: Callable[[], None] = give_back_free_memory,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.growth = growth
        self.interval_s = interval_s
        self._resident = resident
        self._trim = trim
        self._clock = clock
        self._ceiling: int | None = None
        self._settled_at = clock() + interval_s
        self.trims = 0

    def check(self) -> bool:
        """Trims if resident memory is ``growth`` over the ceiling; whether it did."""
        now = self._resident()
        if now is None:
            return False
        if self._ceiling is None or self._clock() < self._settled_at:
            self._ceiling = max(now, self._ceiling or 0)
            return False
        if now - self._ceiling < self.growth:
            return False
        self.trim()
        return True

    def trim(self) -> None:
        """Gives the heap's free memory back now (after a job's departure, say); the ceiling
        is set again over the next ``interval_s``."""
        self._trim()
        self.trims += 1
        self._ceiling = None
        self._settled_at = self._clock() + self.interval_s
