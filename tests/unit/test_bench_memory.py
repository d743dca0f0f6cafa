"""The bench's memory sampler: real /proc readings of real processes, and their summary."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.memory import (
    DAEMON,
    OTHER,
    ROLE_FIGURES,
    TRAINER,
    WORKER,
    MemorySample,
    MemorySampler,
    malloc_arenas,
    memory_metrics,
    parent_pid,
    process_memory,
    process_reading,
    role_of,
    shm_mib,
)
from dalid.server.outputs.pool import PAGE
from dalid.server.outputs.shm import SharedMemorySlab

MIB = 1024 * 1024


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A process that holds 64 MiB of private memory it has written, until it is killed."""
    code = "import sys; b = bytearray(64 << 20); b[::4096] = b'x' * (16 << 10); " \
        "print('ready', flush=True); sys.stdin.read()"  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    assert process.stdout.readline() == b"ready\n"
    yield process
    process.kill()
    process.wait()
    for stream in (process.stdin, process.stdout):
        assert stream is not None
        stream.close()


def test_process_memory_reads_rss_pss_and_high_water_mark(child: subprocess.Popen[bytes]) -> None:
    rss, pss, hwm = process_memory(child.pid)
    assert rss >= 64
    assert pss is not None
    assert 64 <= pss <= rss
    assert hwm >= rss
    assert process_memory(2**22 + 1) == (0.0, None, 0.0)  # above pid_max: no such process


def test_a_sample_counts_each_trainer_with_its_children(child: subprocess.Popen[bytes]) -> None:
    sample = MemorySample.take([os.getpid()], child.pid, None)
    assert sample.processes >= 2  # this process and the child, at least
    alone = process_memory(os.getpid())[0]
    assert sample.trainers_rss_mb >= alone + 64
    assert sample.trainers_pss_mb is not None
    assert sample.all_pss_mb is not None
    assert sample.daemon_pss_mb is not None
    assert sample.all_pss_mb == pytest.approx(sample.trainers_pss_mb + sample.daemon_pss_mb)
    assert sample.daemon_shm_mb == 0.0
    assert sample.gpu_mb is None


def test_shm_counts_the_pages_a_daemons_segments_hold() -> None:
    size = 64 * PAGE
    record = PAGE / MIB  # the page of the segment's record (see dalid.protocol.slabs)
    with SharedMemorySlab(f"dalid-{os.getpid()}-bench-test", size) as slab:
        # Reserved when made (posix_fallocate, dalid.server.outputs.shm.reserve): every page is held
        # before anything is written, and writing takes no more.
        assert shm_mib(os.getpid()) == pytest.approx(size / MIB + record)
        slab.view(0, size // 2)[:] = 1
        assert shm_mib(os.getpid()) == pytest.approx(size / MIB + record)
    assert shm_mib(os.getpid()) == 0.0


def test_the_sampler_samples_until_stopped(child: subprocess.Popen[bytes]) -> None:
    sampler = MemorySampler([child.pid], 0, None, interval_s=0.05)
    with sampler.running():
        time.sleep(0.3)
    assert len(sampler.samples) >= 3
    assert all(s.trainers_rss_mb >= 64 and s.daemon_rss_mb is None for s in sampler.samples)
    data = sampler.to_dict()
    assert data["samples"][0] == asdict(sampler.samples[0])
    assert data["sampler_cpu_s"] > 0


def _sample(t_s: float, trainers: float, daemon: float | None) -> dict[str, object]:
    return {
        "t_ns": round(t_s * 1e9), "processes": 3, "trainers_rss_mb": 2 * trainers,
        "trainers_pss_mb": trainers, "daemon_rss_mb": daemon, "daemon_pss_mb": daemon,
        "daemon_hwm_mb": None if daemon is None else daemon + 100, "daemon_shm_mb": None,
        "gpu_mb": None, "all_pss_mb": trainers + (daemon or 0.0),
    }  # fmt: skip


def test_memory_metrics_take_the_median_in_the_window_and_the_peak_over_all() -> None:
    samples = [_sample(0, 900, 50), _sample(1, 100, 10), _sample(2, 300, 30), _sample(3, 200, 20)]
    metrics = memory_metrics({"samples": samples}, round(0.5e9), round(3.5e9))
    assert metrics["window_samples"] == 3
    assert metrics["trainers_pss_mb"] == 200
    assert metrics["trainers_pss_peak_mb"] == 900  # a sample before the window counts too
    assert metrics["all_pss_mb"] == 220
    assert metrics["daemon_peak_rss_mb"] == 150  # the high-water mark
    assert metrics["daemon_shm_mb"] is None
    assert metrics["gpu_peak_mb"] is None


def test_memory_metrics_without_samples_in_the_window_use_the_nearest() -> None:
    samples = [_sample(0, 100, None), _sample(1, 300, None), _sample(9, 500, None)]
    metrics = memory_metrics({"samples": samples}, round(2e9), round(3e9))
    assert metrics["window_samples"] == 1
    assert metrics["trainers_pss_mb"] == 300
    assert metrics["trainers_pss_peak_mb"] == 500
    assert metrics["daemon_rss_mb"] is None
    assert memory_metrics({}, 0, 1)["samples"] == 0


# A trainer with one DataLoader-like worker, which has a child of its own. The trainer then
# writes 32 MiB of its heap and 16 MiB of a /dev/shm segment (unlinked at once: its pages stay
# mapped, and nothing is left behind), so that each kind of page is its own. Each process says
# its role and pid in one write (print may split a line, and the three write at once); the
# trainer says "ready" last.
_FAMILY = """
import mmap, os, sys
def say(role):
    os.write(1, f"{role} {os.getpid()}\\n".encode())
def wait_for_stdin_to_close():
    sys.stdin.read()
    os._exit(0)
if os.fork() == 0:
    if os.fork() == 0:
        say("other"); wait_for_stdin_to_close()
    say("worker"); wait_for_stdin_to_close()
heap = bytearray(32 << 20)
heap[::4096] = b"x" * (8 << 10)
name = f"/dev/shm/bench-memory-test-{os.getpid()}"
fd = os.open(name, os.O_CREAT | os.O_RDWR, 0o600)
os.unlink(name)
os.ftruncate(fd, 16 << 20)
shared = mmap.mmap(fd, 16 << 20)
shared[::4096] = b"y" * (4 << 10)
say("trainer")
os.write(1, b"ready\\n")
sys.stdin.read()
"""


@pytest.fixture
def family() -> Iterator[dict[str, int]]:
    """The pids of a real trainer, worker and worker's child, by role, while they run."""
    process = subprocess.Popen(
        [sys.executable, "-c", _FAMILY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdin is not None and process.stdout is not None
    pids: dict[str, int] = {}
    try:
        for line in process.stdout:
            if line == "ready\n":
                break
            role, pid = line.split()
            pids[role] = int(pid)
        yield pids
    finally:
        process.stdin.close()  # each of the three reads it to its end, then exits
        process.wait()
        process.stdout.close()
        # The worker and its child outlive the trainer by a moment, until init reaps them.
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() for pid in pids.values()):
            assert time.monotonic() < deadline, "the trainer's children did not exit"
            time.sleep(0.01)


def test_roles_are_told_by_parentage(family: dict[str, int]) -> None:
    trainer, worker, other = family["trainer"], family["worker"], family["other"]
    assert parent_pid(worker) == trainer
    assert parent_pid(other) == worker
    assert role_of(trainer, [trainer], 0) == TRAINER
    assert role_of(worker, [trainer], 0) == WORKER
    assert role_of(other, [trainer], 0) == OTHER
    assert role_of(other, [trainer], other) == DAEMON
    assert parent_pid(2**22 + 1) is None  # above pid_max: no such process


def test_a_reading_splits_pss_by_kind_of_page(family: dict[str, int]) -> None:
    reading = process_reading(family["trainer"])
    assert reading.pss is not None
    assert set(reading.kinds) == {"anon", "file", "shmem"}
    assert reading.kinds["anon"] >= 32  # its heap, written after the fork: its own
    assert reading.kinds["shmem"] == pytest.approx(16, abs=0.5)  # the segment, mapped by it alone
    assert reading.kinds["file"] > 0  # the interpreter and its libraries
    assert sum(reading.kinds.values()) == pytest.approx(reading.pss, abs=0.1)
    worker = process_reading(family["worker"])
    assert worker.kinds["shmem"] == 0.0
    assert worker.kinds["anon"] < 32  # the heap was written after it forked


def test_a_sample_adds_pss_up_by_role(family: dict[str, int]) -> None:
    sample = MemorySample.take([family["trainer"]], family["other"], None)
    assert sample.roles is not None
    assert set(sample.roles) == {DAEMON, TRAINER, WORKER, OTHER}
    counts = {role: figures["processes"] for role, figures in sample.roles.items()}
    # The worker's child stands in for the daemon: it is counted as the daemon, not as other.
    assert counts == {DAEMON: 1, TRAINER: 1, WORKER: 1, OTHER: 0}
    trainer = sample.roles[TRAINER]
    assert trainer["anon_mb"] >= 32
    assert trainer["shmem_mb"] == pytest.approx(16, abs=0.5)
    assert trainer["pss_mb"] == pytest.approx(
        trainer["anon_mb"] + trainer["file_mb"] + trainer["shmem_mb"], abs=0.1
    )
    # Each process once in the roles; all_pss_mb counts the stand-in twice, as a descendant of
    # the trainer and as the daemon.
    assert sample.all_pss_mb is not None
    every = sum(figures["pss_mb"] for figures in sample.roles.values())
    assert every == pytest.approx(sample.all_pss_mb - sample.roles[DAEMON]["pss_mb"], rel=0.05)


def test_memory_metrics_give_each_roles_median_in_the_window() -> None:
    def roles(worker_anon: float) -> dict[str, dict[str, float]]:
        figures = dict.fromkeys(ROLE_FIGURES, 0.0)
        worker = {**figures, "processes": 2, "pss_mb": worker_anon + 5, "anon_mb": worker_anon}
        return {DAEMON: figures, TRAINER: figures, WORKER: worker, OTHER: figures}

    samples = [
        {**_sample(t, 100, None), "roles": roles(anon)}
        for t, anon in ((0, 90), (1, 10), (2, 30), (3, 20))
    ]
    metrics = memory_metrics({"samples": samples}, round(0.5e9), round(3.5e9))
    assert metrics["role_worker_anon_mb"] == 20
    assert metrics["role_worker_pss_mb"] == 25
    assert metrics["role_worker_processes"] == 2
    assert metrics["role_daemon_pss_mb"] == 0.0
    # Samples taken before the split existed have no roles: no figure, rather than zeros.
    assert memory_metrics({"samples": [_sample(1, 100, None)]}, 0, 2)["role_worker_pss_mb"] is None


# Threads that each allocate with malloc and stay alive until stdin closes: glibc gives each a
# malloc arena of its own, unless MALLOC_ARENA_MAX says otherwise.
_THREADS = """
import ctypes, sys, threading
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
started = threading.Barrier(4)
def allocate():
    libc.malloc(4096)
    started.wait()
    sys.stdin.read()
threads = [threading.Thread(target=allocate) for _ in range(3)]
for thread in threads:
    thread.start()
started.wait()
print("ready", flush=True)
for thread in threads:
    thread.join()
"""


@pytest.mark.parametrize(("arena_max", "expected"), [(None, 3), ("1", 0)])
def test_malloc_arenas_are_counted_from_the_maps(arena_max: str | None, expected: int) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if arena_max is not None:
        env["MALLOC_ARENA_MAX"] = arena_max
    process = subprocess.Popen(
        [sys.executable, "-c", _THREADS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        assert process.stdout.readline() == b"ready\n"
        assert malloc_arenas(process.pid) == expected
    finally:
        process.stdin.close()
        process.wait()
        process.stdout.close()
    assert malloc_arenas(process.pid) is None  # gone
