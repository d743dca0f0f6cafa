"""The bench's memory sampler: real /proc readings of real processes, and their summary."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict

import pytest

from bench.memory import MemorySample, MemorySampler, memory_metrics, process_memory, shm_mib
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
