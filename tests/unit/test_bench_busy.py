"""The bench's machine-wide busy cores: /proc/stat's cpu line, and the window arithmetic."""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

import pytest

from bench.busy import (
    BusySampler,
    KernelTicks,
    busy_cores,
    kernel_threads,
    parse_cpu_line,
    read_busy_ticks,
    timeline,
    window_figures,
)
from bench.measure import LoopResult, Probe
from bench.runner import Outcome
from bench.summary import run_metrics

TICK = os.sysconf("SC_CLK_TCK")
S = 1_000_000_000  # ns

# The aggregate lines of /proc/stat read one second apart on a 2-core machine (real format:
# user nice system idle iowait irq softirq steal guest guest_nice).
LINES = (
    "cpu  4892111 0 830400 5205889 7697 0 4886 6220 0 0",
    "cpu  4892262 0 830437 5205902 7697 0 4888 6222 0 0",  # 192 busy ticks of 205
    "cpu  4892312 0 830447 5206042 7698 0 4888 6222 0 0",  # 60 busy ticks of 201
)


def test_the_cpu_line_counts_user_nice_system_irq_softirq_and_steal_as_busy() -> None:
    busy, total = parse_cpu_line(LINES[0])
    assert busy == 4892111 + 0 + 830400 + 0 + 4886 + 6220
    assert total == busy + 5205889 + 7697  # idle and iowait
    # Guest time is in user already; a line with more fields counts the same.
    assert parse_cpu_line(LINES[0] + " 0 0 7")[0] == busy


def test_only_the_aggregate_cpu_line_is_read() -> None:
    for wrong in ("cpu0 1 2 3 4 5 6 7 8 0 0", "intr 1 2 3", "cpu  1 2 3"):
        with pytest.raises(ValueError, match="cpu line"):
            parse_cpu_line(wrong)


def _samples() -> list[tuple[int, int]]:
    return [(10 * S + i * S, parse_cpu_line(line)[0]) for i, line in enumerate(LINES)]


def test_busy_cores_over_a_window_between_samples() -> None:
    samples = _samples()
    # Exactly the first second: 192 ticks.
    assert busy_cores(samples, 10 * S, 11 * S) == pytest.approx(192 / TICK)
    # The whole two seconds: (192 + 60) ticks over 2 s.
    assert busy_cores(samples, 10 * S, 12 * S) == pytest.approx(252 / TICK / 2)
    # Half of each second: ticks are taken as evenly spread between two samples.
    assert busy_cores(samples, 10 * S + S // 2, 11 * S + S // 2) == pytest.approx((96 + 30) / TICK)


def test_a_window_the_samples_do_not_cover_has_no_figure() -> None:
    samples = _samples()
    assert busy_cores(samples, 9 * S, 11 * S) is None  # starts before the first sample
    assert busy_cores(samples, 11 * S, 13 * S) is None  # ends after the last
    assert busy_cores(samples, 11 * S, 11 * S) is None  # empty
    assert busy_cores(samples[:1], 10 * S, 10 * S + 1) is None


def test_common_and_union_windows_of_several_jobs() -> None:
    samples = _samples()
    starts, ends = [10 * S, 10 * S + S // 2], [11 * S + S // 2, 12 * S]
    kernel = [(10 * S, 0), (12 * S, TICK // 5)]  # a fifth of a core all along
    figures = window_figures(samples, starts, ends, kernel)
    assert figures["common"] == pytest.approx((96 + 30) / TICK)  # 10.5 s to 11.5 s
    assert figures["union"] == pytest.approx(252 / TICK / 2)  # 10 s to 12 s
    assert figures["kernel_threads"] == pytest.approx(0.1)
    # Jobs that never ran together have no common window.
    assert window_figures(samples, [11 * S, 10 * S], [12 * S, 10 * S + S // 2])["common"] is None
    assert window_figures(samples, [], []) == {
        "common": None, "union": None, "kernel_threads": None
    }  # fmt: skip
    assert window_figures(samples, starts, ends)["kernel_threads"] is None  # not read


def test_the_timeline_gives_busy_cores_of_each_interval() -> None:
    stamps, cores = zip(*timeline(_samples()), strict=True)
    assert stamps == (11 * S, 12 * S)
    assert cores == pytest.approx((192 / TICK, 60 / TICK))


def test_the_sampler_reads_this_machine_while_it_runs() -> None:
    """A thread spinning on a core shows as busy: at least most of a core over the window."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    sampler = BusySampler(interval_s=0.05)
    spinner = threading.Thread(target=spin)
    with sampler.running():
        spinner.start()
        stop.wait(0.6)
        stop.set()
        spinner.join()
    samples = sampler.samples
    assert len(samples) >= 4
    assert all(b[0] > a[0] and b[1] >= a[1] for a, b in itertools.pairwise(samples))
    assert samples[-1][1] <= read_busy_ticks()
    cores = busy_cores(samples, samples[0][0], samples[-1][0])
    assert cores is not None
    assert 0.5 <= cores <= len(os.sched_getaffinity(0)) + 0.1
    assert not any(t.name == "bench-busy" for t in threading.enumerate())
    # The kernel threads were read at both ends at least, their ticks never going back.
    assert len(sampler.kernel) >= 2
    assert all(b[1] >= a[1] for a, b in zip(sampler.kernel, sampler.kernel[1:], strict=False))


def _comm(pid: str) -> str:
    with open(f"/proc/{pid}/comm") as comm:
        return comm.read().strip()


def test_the_kernel_threads_are_kthreadd_and_its_children() -> None:
    found = kernel_threads()
    assert str(os.getpid()) not in found
    if not found:
        pytest.skip("kthreadd is not visible in this PID namespace")
    assert "2" in found and _comm("2") == "kthreadd"
    ticks = KernelTicks()
    first = ticks.read()
    assert 0 <= first <= ticks.read()


def _job(job: int, start_s: float, end_s: float, daemon_cpu: dict[float, float]) -> dict[str, Any]:
    """A dalid trainer's result: a batch of 10 samples every second from ``start_s`` - 1 to
    ``end_s``, its window from ``start_s`` to ``end_s``; the daemon's CPU as it read it."""
    stamps = [round(t * S) for t in range(int(start_s) - 1, int(end_s) + 1)]

    def probe(t: float) -> Probe:
        return Probe(t_ns=round(t * S), trainer_cpu_s=0.0, workers_cpu_s=0.0,
                     daemon_cpu_s=daemon_cpu[t])  # fmt: skip

    loop = LoopResult(
        contender="dalid", job=job, batch_size=10, warmup_batches=2, stamps_ns=stamps,
        start=probe(start_s), end=probe(end_s), first_batch_s=0.0, trainer_peak_rss_mb=0.0,
        workers_peak_rss_mb=0.0, daemon_peak_rss_mb=0.0, checksum=0.0,
    )  # fmt: skip
    return {"loop": loop.to_dict()}


def test_run_metrics_read_busy_cores_and_the_daemon_over_the_common_window() -> None:
    # Two jobs: windows 10-20 s and 12-22 s. The daemon used 1 ms a sample in the common
    # window (12-20 s: 160 samples, 0.16 s of CPU) and nothing in the tails, as when the
    # batches of the tails were made before the union began.
    cpu = {10.0: 1.0, 12.0: 1.0, 20.0: 1.16, 22.0: 1.16}
    results = [_job(0, 10.0, 20.0, cpu), _job(1, 12.0, 22.0, cpu)]
    # The machine: 1.5 cores busy all along, sampled every second from 9 s to 23 s.
    busy = [(t * S, 1000 + round(1.5 * TICK * (t - 9))) for t in range(9, 24)]
    kernel = [(9 * S, 0), (23 * S, 14 * TICK // 10)]  # a tenth of a core
    metrics = run_metrics(Outcome("dalid", 2, 0, results=results, busy=busy, kernel_busy=kernel))
    assert metrics["rate_window"] == "common window"
    assert metrics["samples_per_s"] == pytest.approx(20.0)
    assert metrics["cpu_ms_per_sample"]["daemon"] == pytest.approx(1.0)
    assert metrics["busy_cores"]["common"] == pytest.approx(1.5)
    assert metrics["busy_cores"]["union"] == pytest.approx(1.5)
    assert metrics["busy_cores"]["account"] == pytest.approx(0.02)  # 1 ms a sample x 20/s
    assert metrics["busy_cores"]["kernel_threads"] == pytest.approx(0.1)
    # Without samples (runs recorded before the sampler) there is no machine figure.
    bare = run_metrics(Outcome("dalid", 2, 0, results=results))["busy_cores"]
    assert bare["common"] is None and bare["union"] is None
