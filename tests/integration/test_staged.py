"""GPU outputs without CUDA IPC, on a real daemon whose GPU is simulated (tests/simulated_gpu.py).

The daemon process, its sockets, its executors, DALI and the shared memory are real; only the
CUDA calls are simulated, on both sides, so the handshake, the choice of each job's output path,
the staged store and the trainer's uploads run here as they do on a GPU. What the simulation
cannot show (page-locked copies, streams, CUDA refusing IPC) is in tests/integration/test_gpu.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import dalid.client as dalid
from dalid.client.errors import DeviceMismatch
from dalid.client.outputs import cuda_device
from dalid.client.outputs import cuda_staged as staged

from ..daemons import DaemonProcess, own_directory, start_daemon, wait_for
from ..simulated_gpu import SIMULATED_UUID, SimulatedDevices
from .helpers import BATCH, ProxyDataset, index_batches, run_in_process, sample, two_output_pipeline

ROOT = Path(__file__).resolve().parents[2]
LENGTH = 37  # 4 full batches of 8 and a partial one of 5


def _start(*args: str) -> tuple[DaemonProcess, Path]:
    directory = own_directory()
    daemon = start_daemon(directory, "--device", "0", *args, module="tests.simulated_gpu")
    return daemon, directory


def _stop(daemon: DaemonProcess, directory: Path) -> str:
    code = daemon.stop()
    log = daemon.log_text()
    segments = daemon.segments()  # its shared memory and its simulated GPU memory
    shutil.rmtree(directory, ignore_errors=True)
    assert code == 0, f"daemon exited with {code}:\n{log}"
    assert not segments, f"daemon left shared memory: {segments}"
    return log


@pytest.fixture(scope="module")
def staging_daemon() -> Iterator[DaemonProcess]:
    """A daemon that stages every job's GPU outputs; its pools hold 8 batches of the tests'."""
    daemon, directory = _start(
        "--gpu-outputs", "staged", "--pool-bytes", "8K", "--slab-bytes", "4K"
    )
    try:
        yield daemon
    finally:
        _stop(daemon, directory)


@pytest.fixture(scope="module")
def auto_daemon() -> Iterator[DaemonProcess]:
    daemon, directory = _start()
    try:
        yield daemon
    finally:
        _stop(daemon, directory)


@pytest.fixture
def trainer_gpu(monkeypatch: pytest.MonkeyPatch) -> SimulatedDevices:
    """This process's GPUs: the simulated daemon's, CUDA IPC working (tests change that)."""
    devices = SimulatedDevices()
    monkeypatch.setattr(cuda_device, "DEVICES", devices)
    monkeypatch.setattr(staged, "_probed", {})
    return devices


def _session(daemon: DaemonProcess, name: str = "staged") -> dalid.Session:
    return dalid.connect(socket=daemon.socket, autostart=False, name=name)


def _check_batches(daemon: DaemonProcess, length: int, num_workers: int = 0) -> str:
    """Runs ``length`` samples through the daemon; every output equals the pipeline run in
    process. Returns the job's output path, as the daemon's status said it."""
    reference = run_in_process(
        two_output_pipeline(prefetch_queue_depth=1),
        [{"data": [sample(i) for i in indices]} for indices in index_batches(length)],
    )
    with _session(daemon) as session:
        proxy = session.proxy(two_output_pipeline())
        loader = dalid.DataLoader(
            session, ProxyDataset(proxy, length), batch_size=BATCH, num_workers=num_workers
        )
        seen = []
        for ((scaled, shifted), indices), want in zip(loader, reference, strict=True):
            np.testing.assert_array_equal(scaled.numpy(), want[0])
            np.testing.assert_array_equal(shifted.numpy(), want[1])
            seen.extend(indices.tolist())
        assert seen == list(range(length))
        return _path_of(daemon, session)


def _path_of(daemon: DaemonProcess, session: dalid.Session) -> str:
    (job,) = [job for job in daemon.status().jobs if job.job_id == session.job_id]
    return job.output_path


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_staging_daemon_delivers_outputs_equal_to_the_pipeline_run_in_process(
    staging_daemon: DaemonProcess,
    trainer_gpu: SimulatedDevices,
    num_workers: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 30 batches through pools of 8: regions come back as their uploads complete.
    length = 30 * BATCH
    reference = run_in_process(
        two_output_pipeline(prefetch_queue_depth=1),
        [{"data": [sample(i) for i in indices]} for indices in index_batches(length)],
    )
    logged = caplog.at_level(logging.WARNING, logger="dalid.client")
    with logged, _session(staging_daemon) as session:
        assert _path_of(staging_daemon, session) == "staged"
        proxy = session.proxy(two_output_pipeline())
        loader = dalid.DataLoader(
            session, ProxyDataset(proxy, length), batch_size=BATCH, num_workers=num_workers
        )
        seen = []
        for ((scaled, shifted), indices), want in zip(loader, reference, strict=True):
            np.testing.assert_array_equal(scaled.numpy(), want[0])  # staged, uploaded
            np.testing.assert_array_equal(shifted.numpy(), want[1])  # a CPU output
            seen.extend(indices.tolist())
        assert seen == list(range(length))
        (device,) = trainer_gpu.opened[1:]  # the probe's device, then the uploads'
        assert device.uploads == len(reference)
        assert session.slabs_opened <= 4 and session.events_opened == 0
        del scaled, shifted  # the last batch's CPU output views its region
        wait_for(lambda: session.live_regions == 0, 5, "every region released")
    (warning,) = [r.getMessage() for r in caplog.records if "staged" in r.getMessage()]
    assert "--gpu-outputs staged" in warning and "two PCIe copies" in warning
    assert device.pinned == set() and device.mapped == {}  # unpinned and unmapped at the end


@pytest.mark.parametrize(
    ("trainer", "reason"),
    [
        (SimulatedDevices(ipc=False), "cudaIpcOpenMemHandle failed: cudaErrorNotSupported"),
        (SimulatedDevices(sees_daemon=False), f"does not see the daemon's GPU {SIMULATED_UUID}"),
    ],
    ids=["ipc-refused", "gpu-not-visible"],
)
def test_a_trainer_that_cannot_open_the_daemons_memory_gets_its_outputs_staged(
    auto_daemon: DaemonProcess,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    trainer: SimulatedDevices,
    reason: str,
) -> None:
    monkeypatch.setattr(cuda_device, "DEVICES", trainer)
    monkeypatch.setattr(staged, "_probed", {})
    with caplog.at_level(logging.WARNING, logger="dalid.client"):
        assert _check_batches(auto_daemon, LENGTH) == "staged"
    (warning,) = [r.getMessage() for r in caplog.records if "staged" in r.getMessage()]
    assert reason in warning
    wait_for(lambda: reason in auto_daemon.log_text(), 5, "the daemon to log the reason")


def test_a_trainer_that_opens_the_probe_gets_cuda_ipc(
    auto_daemon: DaemonProcess, trainer_gpu: SimulatedDevices
) -> None:
    with _session(auto_daemon) as session:
        assert _path_of(auto_daemon, session) == "cuda_ipc"
        proxy = session.proxy(two_output_pipeline())
        loader = dalid.DataLoader(session, ProxyDataset(proxy, LENGTH), batch_size=BATCH)
        held = []
        for (scaled, _), indices in loader:
            held.append((scaled, indices[0].item()))  # views of the daemon's memory
        assert session.events_opened >= 1
    for scaled, first in held:
        np.testing.assert_array_equal(scaled[0].numpy(), sample(first) * 0.5 + 1.0)
    del held  # the daemon frees what the trainer still mapped once it is gone; it lives on


def test_dalid_status_shows_each_jobs_output_path(
    auto_daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staged, "_probed", {})
    monkeypatch.setattr(cuda_device, "DEVICES", SimulatedDevices())
    with _session(auto_daemon, "direct"):
        monkeypatch.setattr(cuda_device, "DEVICES", SimulatedDevices(ipc=False))
        monkeypatch.setattr(staged, "_probed", {})
        with _session(auto_daemon, "copied"):
            command = ["status", "--socket", str(auto_daemon.socket), "--once"]
            out = subprocess.run(
                [sys.executable, "-m", "dalid.server", *command],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=ROOT,
                # Into a pipe the table is as wide as COLUMNS says: wide enough for every column.
                env={**os.environ, "COLUMNS": "250"},
                check=True,
            ).stdout
    lines = out.splitlines()
    rows = {line.split()[1]: line for line in lines if "direct" in line or "copied" in line}
    assert rows["direct"].rstrip().endswith("cuda ipc"), out
    assert rows["copied"].rstrip().endswith("staged"), out


def test_a_daemon_of_cuda_ipc_only_refuses_a_trainer_that_cannot_use_it(
    trainer_gpu: SimulatedDevices,
) -> None:
    daemon, directory = _start("--gpu-outputs", "ipc")
    try:
        trainer_gpu.ipc = False
        with pytest.raises(DeviceMismatch, match="--gpu-outputs ipc"):
            _session(daemon)
    finally:
        _stop(daemon, directory)
