"""The daemon's malloc arena limit, seen in a fresh process through glibc's own report."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dalid.server.intake.heap import (
    DALI_POOL_ENV,
    DALI_SHRINK_ENV,
    HeapKeeper,
    host_buffers_from_malloc,
    host_buffers_kept,
    limit_malloc_arenas,
)

# Counts the arenas glibc made after four threads each allocated, with or without the limit.
# Each new thread that allocates gets an arena of its own until the limit is reached.
PROBE = """
import ctypes, ctypes.util, os, sys, tempfile, threading
from dalid.server.intake.heap import HeapKeeper, limit_malloc_arenas
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


# Frees most of 256 MiB of small blocks at scattered places (every block but one in 16, so
# that the arena cannot shrink from its top), as runs of several sizes leave the daemon's heap;
# then asks a keeper to check, and prints RssAnon before and after, in MiB.
FRAGMENTED = """
import ctypes, ctypes.util, sys
from dalid.server.intake.heap import HeapKeeper, anonymous_resident_bytes
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
keeper = HeapKeeper(growth=64 << 20, interval_s=0.0)
assert not keeper.check()  # its ceiling: what the process holds before
blocks = [libc.malloc(64 << 10) for _ in range(4096)]
for block in blocks:
    libc.memset(block, 1, 64 << 10)
for index, block in enumerate(blocks):
    if index % 16:
        libc.free(block)
before = anonymous_resident_bytes()
trimmed = keeper.check()
after = anonymous_resident_bytes()
print(int(trimmed), before >> 20, after >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_a_keeper_gives_back_free_memory_scattered_through_the_heap() -> None:
    result = subprocess.run(
        [sys.executable, "-c", FRAGMENTED], capture_output=True, text=True, timeout=60, check=True
    )
    trimmed, before, after = (int(word) for word in result.stdout.split())
    assert trimmed == 1
    # 240 MiB were freed and stayed resident; the trim gives back nearly all of it.
    assert before - after > 200, (before, after)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_keeper_trims_on_growth_over_what_the_runs_took_back() -> None:
    clock, resident, trims = Clock(), [100 << 20], []

    def trim() -> None:
        trims.append(clock.now)
        resident[0] = 120 << 20  # what the trim left resident

    keeper = HeapKeeper(
        growth=32 << 20, interval_s=30.0, resident=lambda: resident[0], trim=trim, clock=clock
    )
    for now, mib in ((10.0, 150), (20.0, 200)):  # the first runs: the ceiling is set
        clock.now, resident[0] = now, mib << 20
        assert not keeper.check()
    clock.now, resident[0] = 40.0, 230 << 20  # 30 MiB over the ceiling of 200
    assert not keeper.check()
    resident[0] = 240 << 20
    assert keeper.check()
    assert trims == [40.0]
    # The runs take back their working set: not growth, however soon after the trim.
    for now, mib in ((45.0, 180), (60.0, 230), (69.0, 220)):
        clock.now, resident[0] = now, mib << 20
        assert not keeper.check()
    clock.now, resident[0] = 80.0, 250 << 20
    assert not keeper.check()
    resident[0] = 262 << 20
    assert keeper.check()
    assert keeper.trims == 2


def test_a_keeper_trims_at_most_once_an_interval() -> None:
    clock, resident = Clock(), [100 << 20]
    keeper = HeapKeeper(
        growth=1 << 20, interval_s=30.0, resident=lambda: resident[0], trim=lambda: None,
        clock=clock,
    )  # fmt: skip
    clock.now = 31.0
    keeper.check()
    keeper.trim()
    for now in (35.0, 45.0, 60.0):
        clock.now = now
        resident[0] += 100 << 20
        assert not keeper.check()
    clock.now = 62.0
    resident[0] += 100 << 20
    assert keeper.check()


def test_a_keeper_without_a_reading_never_trims() -> None:
    trims: list[int] = []
    keeper = HeapKeeper(interval_s=0.0, resident=lambda: None, trim=lambda: trims.append(1))
    assert not keeper.check()
    assert trims == []


# A DALI pipeline whose runs make 77 MiB of host outputs, built, run and destroyed; prints how
# much more anonymous memory the process holds afterwards, once the heap is trimmed, in MiB.
# With "1", as the daemon does, DALI takes its host buffers from malloc first.
DALI_BUFFERS = """
import gc, resource, sys
from dalid.server.intake.heap import (
    anonymous_resident_bytes, give_back_free_memory, host_buffers_from_malloc,
    limit_malloc_arenas,
)
limit_malloc_arenas(1)
if sys.argv[1] == "1":
    host_buffers_from_malloc()
from nvidia.dali import fn, pipeline_def

@pipeline_def(batch_size=int(sys.argv[2]), num_threads=2, device_id=None, seed=0)
def noise():
    return fn.random.uniform(range=[0.0, 1.0], shape=[224, 224, 3])

before = anonymous_resident_bytes()
pipe = noise()
pipe.build()
for _ in range(8):
    outputs = pipe.run()
    del outputs
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    outputs = pipe.run()
    del outputs
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
del pipe
gc.collect()
give_back_free_memory()
print(faults // 4, (anonymous_resident_bytes() - before) >> 20)
"""


def after_a_pipeline(from_malloc: bool, batch_size: int = 128) -> tuple[int, int]:
    """Page faults a warm run takes, and MiB kept once the pipeline is gone and trimmed."""
    env = {k: v for k, v in os.environ.items() if k != DALI_POOL_ENV}
    result = subprocess.run(
        [sys.executable, "-c", DALI_BUFFERS, str(int(from_malloc)), str(batch_size)],
        capture_output=True, text=True, timeout=120, check=True, env=env,
    )  # fmt: skip
    faults, kept = result.stdout.split()[-2:]
    return int(faults), int(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_dali_host_buffers_go_back_with_their_pipeline() -> None:
    # DALI 2.4 left to itself keeps them (221 MiB here, measured), so the daemon sets them
    # to come from malloc; a trim then gives them back.
    assert after_a_pipeline(from_malloc=True)[1] < 32


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_dalis_own_pool_spares_a_warm_run_the_page_faults_of_malloc() -> None:
    """What --dali-host-pool trades: a run's 38.5 MB of outputs, past glibc's largest mapping
    threshold (32 MiB), is mapped apart and faulted in anew at every run from malloc (9,400
    pages); DALI's own pool keeps it, and a warm run takes almost none."""
    from_malloc, _ = after_a_pipeline(from_malloc=True, batch_size=64)
    pooled, _ = after_a_pipeline(from_malloc=False, batch_size=64)
    assert from_malloc > 8_000
    assert pooled < 1_000


def test_host_buffers_from_malloc_leaves_a_setting_of_the_users(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DALI_POOL_ENV, "1M")
    host_buffers_from_malloc()
    assert os.environ[DALI_POOL_ENV] == "1M"
    monkeypatch.delenv(DALI_POOL_ENV)
    host_buffers_from_malloc()
    assert os.environ[DALI_POOL_ENV] == "0"


# Runs of a legacy-executor pipeline as a shared pipeline's runs come, one batch or four
# (32 or 128 samples of 3x224x224 float32), its buffers from malloc as in the daemon; prints the
# page faults a warm run takes. With "1", DALI keeps each host buffer at its largest size.
LEGACY_RUNS = """
import resource, sys
import numpy as np
from dalid.server.intake.heap import (
    host_buffers_from_malloc, host_buffers_kept, limit_malloc_arenas,
)
limit_malloc_arenas(1)
host_buffers_from_malloc()
if sys.argv[1] == "1":
    host_buffers_kept()
from nvidia.dali import fn, pipeline_def, types

@pipeline_def(batch_size=128, num_threads=2, device_id=None, exec_dynamic=False)
def crops():
    images = fn.external_source(name="x", dtype=types.UINT8)
    return fn.crop_mirror_normalize(images, crop=(224, 224), dtype=types.FLOAT, output_layout="CHW")

pipe = crops()
pipe.build()
four = np.zeros((128, 256, 256, 3), np.uint8)
def run(i):
    pipe.feed_input("x", four if i % 3 == 0 else four[:32])
    pipe._run_once()
    pipe.outputs()
    pipe.release_outputs()
for i in range(6):
    run(i)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(12):
    run(i)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) // 12)
"""


def legacy_run_faults(kept: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k not in (DALI_POOL_ENV, DALI_SHRINK_ENV)}
    result = subprocess.run(
        [sys.executable, "-c", LEGACY_RUNS, str(int(kept))],
        capture_output=True, text=True, timeout=120, check=True, env=env,
    )  # fmt: skip
    return int(result.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_legacy_buffers_kept_at_their_largest_spare_runs_of_every_size_the_faults() -> None:
    """What a CPU daemon relies on (docs/design/host-buffers.md): the legacy executor reuses
    its buffers, but DALI shrinks one a small run fills below half, and the next large run
    maps and faults in its 77 MB anew (8,300 pages measured); kept at their largest, a warm
    run of any size takes almost no fault."""
    assert legacy_run_faults(kept=False) > 8_000
    assert legacy_run_faults(kept=True) < 1_000


def test_host_buffers_kept_leaves_a_setting_of_the_users(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DALI_SHRINK_ENV, "0.9")
    host_buffers_kept()
    assert os.environ[DALI_SHRINK_ENV] == "0.9"
    monkeypatch.delenv(DALI_SHRINK_ENV)
    host_buffers_kept()
    assert os.environ[DALI_SHRINK_ENV] == "0"
