"""A real short bench run records the machine's busy cores over its jobs' timed windows."""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.busy import INTERVAL_S, kernel_threads
from bench.config import QUICK
from bench.dataset import make_imagefolder
from bench.runner import run_once
from bench.summary import run_metrics

from ..daemons import own_directory

TICK = os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    directory = own_directory("dalid-busy-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "jobs"), [("dali", 2), ("dalid", 1)])
def test_a_run_records_busy_cores_over_its_windows(workdir: Path, kind: str, jobs: int) -> None:
    dataset = make_imagefolder(workdir / "images", num_images=64, num_classes=2, seed=3)
    settings = QUICK.with_(
        images=64, batch_size=16, workers=1, threads=1, epochs=4, dataset_root=str(dataset.root)
    )
    outcome = run_once(kind, jobs, 0, settings, workdir)
    assert outcome.error is None, outcome.error
    samples = outcome.busy
    assert len(samples) >= 3
    # Sampled all through the run, in time order, on the trainers' clock.
    assert all(b[0] > a[0] and b[1] >= a[1] for a, b in itertools.pairwise(samples))
    loops = [result["loop"] for result in outcome.results]
    assert samples[0][0] <= min(loop["start"]["t_ns"] for loop in loops)
    assert samples[-1][0] >= max(loop["end"]["t_ns"] for loop in loops)
    gaps = [(b[0] - a[0]) / 1e9 for a, b in itertools.pairwise(samples)]
    assert max(gaps) < INTERVAL_S + 1.0
    busy = run_metrics(outcome)["busy_cores"]
    cores = len(os.sched_getaffinity(0))
    starts = [loop["start"]["t_ns"] for loop in loops]
    ends = [loop["end"]["t_ns"] for loop in loops]
    windows = {"common": min(ends) - max(starts), "union": max(ends) - min(starts)}
    for window, length_ns in windows.items():
        value = busy[window]
        assert value is not None
        # Between two samples the busy ticks are taken as linear: at each end of the window
        # that may be off by all cores for the gap between samples, and by a tick a core.
        slack = 2 * cores * (max(gaps) + 1 / TICK) / (length_ns / 1e9)
        # The trainers decoded JPEGs all through the window: some of a core at least.
        assert 0.2 - slack < value <= cores + slack, (window, value, slack)
    assert busy["account"] > 0
    # The kernel's threads were read at the run's ends at least (none visible: no figure).
    assert len(outcome.kernel_busy) >= 2
    if kernel_threads():
        assert busy["kernel_threads"] is not None
        assert busy["kernel_threads"] >= 0
