"""File inputs stall only their own job, with a real daemon and a real job beside them.

A path to a FIFO would block a DALI thread in ``open()`` until a writer came; a device or a
directory is no dataset's file either. Each is a bad sample of its own job, named with why,
while a job on the same graph carries on; a pipeline that does get stuck inside DALI (here a
Python operator that opens a FIFO, as DALI's reader would open a path made a FIFO after its
check) neither holds up the daemon's loop when its job ends nor keeps SIGTERM from stopping the
daemon cleanly. See docs/design/checking-paths.md and docs/security.md.

The tests never open a FIFO themselves but with ``O_NONBLOCK``, and release and remove each one
they made, whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import dalid.client as dalid

from ..daemons import ROOT, STARTED_PIDS, DaemonProcess, ping_pid, start_daemon
from . import dropin_examples as examples
from .reading_job import path_sample, read_pipeline

READER = [sys.executable, "-m", "tests.integration.reading_job"]
STEADY = [sys.executable, "-m", "tests.integration.steady_job"]
STALLED_JOB = [sys.executable, "-m", "tests.integration.stalled_job"]

# A pipeline of the daemon's repository whose Python operator opens a FIFO for each batch: a
# DALI call that does not return until a writer comes.
STALLED = """
import os
import numpy as np
from nvidia.dali import fn
from nvidia.dali.pipeline import pipeline_def


@pipeline_def(batch_size=2, num_threads=1)
def stalled(fifo: str = ""):
    def wait(array):
        open(fifo + ".entered", "w").close()
        with open(fifo, "rb") as pipe:
            pipe.read()
        return np.asarray(array)

    data = fn.external_source(name="data", no_copy=True)
    return fn.python_function(data, function=wait)
"""


def release(fifo: Path) -> None:
    """Lets a reader waiting in ``open()`` of ``fifo`` go on (it then reads its end); never
    blocks, and does nothing when none waits."""
    with contextlib.suppress(OSError):  # ENXIO: no reader
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    try:
        yield path
    finally:
        release(path)
        path.unlink(missing_ok=True)


def started(command: list[str]) -> subprocess.Popen[str]:
    """A job beside the test, waited for until it prints "running"."""
    job = subprocess.Popen(
        command,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    STARTED_PIDS.add(job.pid)
    assert job.stdout is not None
    line = job.stdout.readline()
    assert line.strip() == "running", line + job.communicate(timeout=60)[0]
    return job


def ended(job: subprocess.Popen[str]) -> None:
    if job.poll() is None:
        job.kill()
    job.communicate(timeout=60)


def stopped_cleanly(daemon: DaemonProcess) -> None:
    """SIGTERM with peers connected: exit 0, nothing left behind."""
    code = daemon.stop(timeout=60)
    log = daemon.log_text()
    assert code == 0, log
    # Nothing of its socket's: no socket, lock, in-flight record or crash suspects.
    left = [path.name for path in daemon.socket.parent.glob(daemon.socket.name + "*")]
    assert left == [], log
    assert daemon.segments() == set(), log
    assert "Assertion failed" not in log


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory", "proc"])
def test_what_is_not_a_regular_file_is_a_bad_sample_beside_a_job_on_the_same_graph(
    short_tmp: Path, tmp_path: Path, fifo: Path, kind: str
) -> None:
    images = examples.make_image_folder(tmp_path / "images", classes=2, per_class=4)
    odd, what = {
        "fifo": (fifo, "a FIFO (named pipe)"),
        "dev-zero": (Path("/dev/zero"), "a character device"),
        "directory": (images, "a directory"),
        "proc": (Path("/proc/self/status"), "a file the kernel makes as it is read (/proc, /sys)"),
    }[kind]
    daemon = start_daemon(short_tmp)
    reader = None
    try:
        command = [*READER, "--socket", str(daemon.socket), "--images", str(images)]
        reader = started(command)
        good = sorted(images.rglob("*.jpg"))[:3]
        order = [good[0], odd, good[1], good[2]]
        with dalid.connect(socket=daemon.socket, autostart=False, name="odd") as session:
            raising = session.proxy(read_pipeline())
            batch = torch.utils.data.default_collate([raising(path_sample(p)) for p in order])
            with pytest.raises(dalid.BatchError) as caught:
                session.produce_data(batch)
            assert caught.value.positions == [1]
            assert f"{odd} is not a regular file ({what})" in str(caught.value)
            skipping = session.proxy(read_pipeline(), on_error="skip")
            batch = torch.utils.data.default_collate([skipping(path_sample(p)) for p in order])
            assert session.produce_data(batch).shape == (3, 32, 32, 3)
            (report,) = session.last_bad_samples
            assert report.position == 1 and "is not a regular file" in report.message
            # One DALI pipeline served both jobs.
            (shared,) = daemon.status().pipelines
            assert len(shared.jobs) == 2
            # It carries on, and finishes.
            out, _ = reader.communicate("stop\n", timeout=180)
            assert reader.returncode == 0 and out.startswith("ok "), out
            assert int(out.split()[1]) > 5, out
            # Stopped with this job still connected.
            stopped_cleanly(daemon)
    finally:
        if reader is not None:
            ended(reader)
        daemon.stop()


def test_a_batch_of_files_over_its_jobs_share_is_refused_beside_a_job_on_the_same_graph(
    short_tmp: Path, tmp_path: Path
) -> None:
    """The reproduction: 8 paths to a sparse 1 GiB file OOM-killed a daemon in a 4 GiB cgroup.
    Here to scale (4 paths to a 128 MiB one, a 64 MiB --input-memory, a job's share 32 MiB): it is
    refused by the files' sizes before DALI reads a byte, and the job beside it carries on."""
    images = examples.make_image_folder(tmp_path / "images", classes=2, per_class=4)
    sparse = tmp_path / "sparse.bin"
    with sparse.open("wb") as file:
        file.truncate(128 << 20)
    daemon = start_daemon(short_tmp, "--input-memory", "64M")
    reader = None
    try:
        command = [*READER, "--socket", str(daemon.socket), "--images", str(images)]
        reader = started(command)
        with dalid.connect(socket=daemon.socket, autostart=False, name="greedy") as session:
            proxy = session.proxy(read_pipeline())
            batch = torch.utils.data.default_collate([proxy(path_sample(sparse)) for _ in range(4)])
            with pytest.raises(dalid.BatchError) as caught:
                session.produce_data(batch)
            message = str(caught.value)
            assert "the files of this batch come to 512 MiB, more than the 32 MiB" in message
            assert f"the largest is input 'paths': {sparse} (128 MiB)" in message
            assert "--input-memory" in message
            # Its next batch within the share runs, on the same pipeline.
            good = sorted(images.rglob("*.jpg"))[:4]
            batch = torch.utils.data.default_collate([proxy(path_sample(p)) for p in good])
            assert session.produce_data(batch).shape == (4, 32, 32, 3)
            (shared,) = daemon.status().pipelines
            assert len(shared.jobs) == 2
        out, _ = reader.communicate("stop\n", timeout=180)
        assert reader.returncode == 0 and out.startswith("ok "), out
        assert daemon.process.poll() is None, daemon.log_text()
    finally:
        if reader is not None:
            ended(reader)
        daemon.stop()


def test_a_pipeline_stuck_inside_dali_holds_up_neither_the_daemon_nor_its_stop(
    short_tmp: Path, tmp_path: Path, fifo: Path
) -> None:
    """The job whose pipeline is stuck ends; the daemon answers at once, a job beside it
    carries on, and SIGTERM with that job connected stops the daemon cleanly."""
    repository = tmp_path / "repository"
    repository.mkdir()
    (repository / "stalled.py").write_text(STALLED)
    daemon = start_daemon(
        short_tmp, "--pipelines", str(repository), "--repository-operators", "PythonFunction"
    )
    steady = stuck = None
    entered = fifo.with_name(fifo.name + ".entered")
    try:
        steady = started([*STEADY, "--socket", str(daemon.socket)])
        stuck = started([*STALLED_JOB, "--socket", str(daemon.socket), "--fifo", str(fifo)])
        deadline = time.monotonic() + 60
        while not entered.exists():
            assert time.monotonic() < deadline, daemon.log_text()
            time.sleep(0.05)
        # Its trainer goes; its pipeline, inside DALI, cannot be stopped.
        stuck.send_signal(signal.SIGKILL)
        stuck.communicate(timeout=60)
        # The loop answers while the job's end is handled (it waited 10 s a stuck pipeline).
        started_at = time.monotonic()
        while "job 2 (stalled) ended" not in daemon.log_text():
            assert ping_pid(daemon.socket, timeout=5.0) == daemon.pid, daemon.log_text()
            assert time.monotonic() - started_at < 60, daemon.log_text()
        assert ping_pid(daemon.socket, timeout=5.0) == daemon.pid
        # The job beside it carried on.
        out, _ = steady.communicate("stop\n", timeout=90)
        assert steady.returncode == 0 and out.startswith("ok "), out
        # A new job, then SIGTERM with it connected.
        steady = started([*STEADY, "--socket", str(daemon.socket)])
        stopped_cleanly(daemon)
        # It was still stuck: the process exited without waiting for it.
        assert "exiting without waiting for a DALI call" in daemon.log_text()
    finally:
        for job in (steady, stuck):
            if job is not None:
                ended(job)
        daemon.stop()
        entered.unlink(missing_ok=True)
