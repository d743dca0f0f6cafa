"""What the leak checks (:mod:`tests.leaks`) leave to its owner because it is not dalid's: things
in the test process that the libraries below dalid make on their own, at times of their own
choosing, which no warm-up before the first snapshot can make once for all.

Each is told apart precisely, never by its kind alone: a native thread by the name its library
gives it, the CUDA driver's file by its name, which carries this process's pid; and a native
thread nobody named only by its origin, in a test whose code under test is not dalid's (DALI's
own proxy, run beside dalid's by the conformance cases). A thread or descriptor of dalid's
(a ZeroMQ thread, a slab's descriptor, an unnamed native thread in a test of dalid's) is still
a leak.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from dalid.protocol import slabs

# Native threads that libraries below dalid start and name, and keep until the process exits.
THREAD_NAMES: dict[re.Pattern[str], str] = {
    # One per CUDA context; the context of the process is made before the first snapshot, but
    # the driver may start its event handler anew for the contexts a library makes later.
    re.compile(r"cuda-EvtHandlr"): "the CUDA driver's event handler",
    # The driver's worker threads (cuda00001400006, ...): started on first use of a stream
    # callback or host function, by torch, DALI or CuPy, and kept.
    re.compile(r"cuda\d+"): "the CUDA driver's callback workers",
    # jemalloc, the allocator of DALI's GPU decoding libraries, starts a background purging
    # thread per arena as more threads first allocate through it, up to one a core: a test whose
    # pipeline runs more threads than any before it starts more. dalid links no jemalloc.
    re.compile(r"jemalloc_bg_thd"): "jemalloc's background purging threads",
}

# The CUDA driver's own file of a process, /dev/shm/cuda.shm.<n>.<its pid, in hex>.<n>: opened
# on the first use of CUDA IPC (a trainer opening a daemon's slab), kept open until the process
# exits, and left in /dev/shm after it (dalid's segments are named dalid-*, and only those are
# counted as segments).
DRIVER_FILE = re.compile(r"cuda\.shm\.\d+\.(?P<pid>[0-9a-f]+)\.\d+")

# Set on a test's node by a fixture whose test runs code that is not dalid's, naming that code
# ("DALI's own proxy"): native threads that nobody named are then that code's.
FOREIGN_CODE = pytest.StashKey[str]()

_PROCESS_NAME = Path("/proc/self/comm").read_text().strip()


def foreign_thread(name: str, foreign_code: str | None) -> str | None:
    """Whose a new native thread of this process named ``name`` is, if not dalid's (None: it may
    be dalid's). A thread that nobody named carries the name of the process (or of the thread
    that started it, a Python thread's being the process's): that one is the foreign code's,
    in a test that ran only foreign code."""
    for pattern, owner in THREAD_NAMES.items():
        if pattern.fullmatch(name):
            return owner
    if foreign_code is not None and name == _PROCESS_NAME:
        return foreign_code
    return None


def driver_file(target: str) -> bool:
    """Whether an open descriptor's target is the CUDA driver's own file of this process (also
    once unlinked: the kernel then names it with " (deleted)")."""
    path = Path(target.removesuffix(" (deleted)"))
    match = DRIVER_FILE.fullmatch(path.name)
    return (
        path.parent == slabs.SHM_DIR and match is not None and int(match["pid"], 16) == os.getpid()
    )
