"""A real short dalid bench run beside the bench's background load: the spinners run through
it and are gone after it, and the daemon's threads' figures of its messages' waits, its loop's
wakes and reap, and its executors' forming of runs come from the probed daemon."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.config import QUICK
from bench.dataset import make_imagefolder
from bench.runner import run_once
from bench.summary import run_metrics

from ..daemons import own_directory


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    directory = own_directory("dalid-threads-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _spinners() -> set[int]:
    """This process's children that run the background load's loop."""
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                parent = int(stat.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"while True" in command:
            found.add(int(pid))
    return found


@pytest.mark.slow
def test_a_dalid_run_beside_a_background_load_reads_the_daemons_waits(workdir: Path) -> None:
    dataset = make_imagefolder(workdir / "images", num_images=64, num_classes=2, seed=5)
    settings = QUICK.with_(
        images=64, batch_size=16, workers=1, threads=1, epochs=4, background_load=1,
        dataset_root=str(dataset.root),
    )  # fmt: skip
    outcome = run_once("dalid", 1, 0, settings, workdir)
    assert outcome.error is None, outcome.error
    assert outcome.background_cores > 0  # the spinner ran through the run
    assert not _spinners()  # and is gone after it
    figures = run_metrics(outcome)["daemon_threads"]
    assert figures is not None
    for name in ("io_wait_us_per_message", "io_core_wait_us_per_message",
                 "io_blocks_per_message", "io_preemptions_per_message",
                 "io_run_delay_us_per_message"):  # fmt: skip
        assert figures[name] is not None and figures[name] >= 0, name
    assert figures["messages_per_run"] is not None and figures["messages_per_run"] >= 1
    assert figures["io_wakes_per_s"] is not None and figures["io_wakes_per_s"] > 0
    assert figures["io_reap_ms_per_s"] is not None and figures["io_reap_ms_per_s"] >= 0
    # Forming runs is a part of the executors' CPU, not more than all of it.
    assert (
        0
        < figures["forming_us_per_sample"]
        <= figures["executor_us_per_sample"] + (figures["copy_out_us_per_sample"] or 0.0)
    )


@pytest.mark.slow
def test_a_probed_daemon_counts_its_messages_steps_when_asked(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With DALID_BENCH_IO_STEPS set, the daemon's I/O thread's CPU a message comes by step,
    each a part of the messages' CPU; its outbox's sends and garbage collections are counted
    with or without."""
    from bench.threads import MESSAGE_STEPS, STEPS_ENV

    dataset = make_imagefolder(workdir / "steps", num_images=32, num_classes=2, seed=6)
    settings = QUICK.with_(
        images=32, batch_size=16, workers=1, threads=1, epochs=3, dataset_root=str(dataset.root)
    )
    monkeypatch.setenv(STEPS_ENV, "1")
    outcome = run_once("dalid", 1, 0, settings, workdir)
    assert outcome.error is None, outcome.error
    figures = run_metrics(outcome)["daemon_threads"]
    assert figures is not None
    steps = [figures[f"io_{step}_us_per_message"] for step in MESSAGE_STEPS]
    assert all(value is not None and value >= 0 for value in steps), steps
    assert figures["io_decode_us_per_message"] > 0 and figures["io_handle_us_per_message"] > 0
    between = figures["io_between_steps_us_per_message"]
    assert between is not None and between >= 0  # the steps are parts of the messages' CPU
    assert figures["io_outbox_ms_per_s"] is not None and figures["io_gc_ms_per_s"] is not None
