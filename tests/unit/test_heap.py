"""The daemon's malloc arena limit, seen in a fresh process through glibc's own report."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dalid.server.intake.heap import limit_malloc_arenas

# Counts the arenas glibc made after four threads each allocated, with or without the limit.
# Each new thread that allocates gets an arena of its own until the limit is reached.
PROBE = """
import ctypes, ctypes.util, os, sys, tempfile, threading
from dalid.server.intake.heap import limit_malloc_arenas
if sys.argv[1] != "0":
    assert limit_malloc_arenas(int(sys.argv[1]))
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
libc.fclose.argtypes = (ctypes.c_void_p,)
gate = threading.Barrier(4)
def allocate():
    gate.wait()
    libc.malloc(1 << 20)
threads = [threading.Thread(target=allocate) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
with tempfile.NamedTemporaryFile(suffix=".xml") as report:
    stream = libc.fopen(report.name.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print(open(report.name).read().count("<heap nr="))
"""


def arenas_after_four_threads(limit: int) -> int:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(limit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(result.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas")
def test_one_arena_serves_every_thread_once_limited() -> None:
    assert arenas_after_four_threads(0) > 1  # glibc's default: the threads get arenas of their own
    assert arenas_after_four_threads(1) == 1


def test_zero_leaves_glibcs_default() -> None:
    assert limit_malloc_arenas(0) is False
