"""Giving memory the daemon freed back to the system.

glibc's allocator keeps what a program frees for its next allocations, per thread arena, and
raises its threshold for mapping large blocks apart once such a block is freed: after a client
has sent many large messages, the freed frames stay in the daemon's heap. The daemon asks glibc
to return them once a job ends (``malloc_trim``), so that memory a job's traffic took goes back
when the job does. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger("dalid.server")


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def give_back_free_memory() -> None:
    """Returns the free memory of every heap arena to the system (glibc only)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
