"""GPU outputs without CUDA IPC, for real: a daemon on GPU 0 that stages them, trainers that
upload them on their own streams, the IPC probe on a real device, and a trainer in another PID
namespace. See Note [Staged GPU outputs] in server/outputs/cuda_staged.py.

Skipped without CUDA; tests/integration/test_staged.py runs the same paths on a simulated GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import dalid.client as dalid

from ..daemons import DaemonProcess, kill_leftovers, own_directory, start_daemon
from ..host_sync import host_syncs_raise
from .helpers import BATCH, ProxyDataset, gpu_pipeline, index_batches, run_in_process, sample

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
LENGTH = 37


def _start(*args: str) -> tuple[DaemonProcess, Path]:
    directory = own_directory()
    return start_daemon(directory, "--device", "0", *args), directory


def _stop(daemon: DaemonProcess, directory: Path) -> str:
    code = daemon.stop()
    log = daemon.log_text()
    segments = daemon.segments()
    shutil.rmtree(directory, ignore_errors=True)
    assert code == 0, f"daemon exited with {code}:\n{log}"
    assert not segments, f"daemon left shared memory: {segments}"
    return log


@pytest.fixture(scope="module")
def staging_daemon() -> Iterator[DaemonProcess]:
    daemon, directory = _start("--gpu-outputs", "staged", "--pool-bytes", "64K")
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


def _path_of(daemon: DaemonProcess, job_id: int) -> str:
    (job,) = [job for job in daemon.status().jobs if job.job_id == job_id]
    return job.output_path


@pytest.mark.parametrize("num_workers", [0, 2])
def test_staged_outputs_equal_in_process_run_and_upload_without_host_sync(
    staging_daemon: DaemonProcess, num_workers: int
) -> None:
    length = 40 * BATCH  # pools of 64 KiB: regions come back as uploads complete
    reference = run_in_process(
        gpu_pipeline(prefetch_queue_depth=1),
        [{"data": [sample(i) for i in indices]} for indices in index_batches(length)],
    )
    side = torch.cuda.Stream()
    with dalid.connect(socket=staging_daemon.socket, autostart=False, name="staged") as session:
        assert _path_of(staging_daemon, session.job_id) == "staged"
        proxy = session.proxy(gpu_pipeline())
        loader = dalid.DataLoader(
            session, ProxyDataset(proxy, length), batch_size=BATCH, num_workers=num_workers
        )
        differences = []
        torch.cuda.synchronize()
        with host_syncs_raise(), torch.cuda.stream(side):  # any host synchronization raises
            for ((scaled, shifted), _), want in zip(loader, reference, strict=True):
                assert scaled.device == torch.device("cuda", torch.cuda.current_device())
                assert shifted.device.type == "cpu"
                np.testing.assert_array_equal(shifted.numpy(), want[1])
                expected = torch.as_tensor(want[0]).to("cuda", non_blocking=True)
                differences.append((scaled - expected).abs().max())
        side.synchronize()
        assert [float(d) for d in differences] == [0.0] * len(reference)
        assert session.events_opened == 0  # staged outputs come with no event


def test_a_trainer_that_sees_the_daemons_gpu_gets_cuda_ipc_and_probes_once(
    auto_daemon: DaemonProcess,
) -> None:
    from dalid.client.outputs import cuda_staged as staged

    with dalid.connect(socket=auto_daemon.socket, autostart=False, name="ipc") as first:
        assert _path_of(auto_daemon, first.job_id) == "cuda_ipc"
        welcome = first._daemon.welcome
        assert welcome.ipc_probe
        assert staged._probed[(os.getpid(), welcome.device_uuid, welcome.ipc_probe)] == ""
        probes = dict(staged._probed)
        with dalid.connect(socket=auto_daemon.socket, autostart=False, name="ipc2") as second:
            assert _path_of(auto_daemon, second.job_id) == "cuda_ipc"
        assert staged._probed == probes  # the same probe, not opened again


def _unshared(command: list[str]) -> list[str] | None:
    """``command`` in new user and PID namespaces, if this machine lets us make them."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = [unshare, "--user", "--map-root-user", "--pid", "--fork", "--mount", "--mount-proc"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, check=False)
    return [*prefix, *command] if probe.returncode == 0 else None


@pytest.mark.slow
def test_a_trainer_in_another_pid_namespace_still_gets_its_outputs(
    auto_daemon: DaemonProcess,
) -> None:
    command = [sys.executable, "-m", "tests.integration.gpu_job"]
    command += ["--socket", str(auto_daemon.socket), "--workers", "0", "--length", "48"]
    unshared = _unshared(command)
    if unshared is None:
        pytest.skip("cannot make user and PID namespaces here (unshare refused)")
    before = auto_daemon.log_text()
    job = subprocess.Popen(
        unshared,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        out, _ = job.communicate(timeout=180)
    finally:
        kill_leftovers([job])
    assert job.returncode == 0 and "ok 48" in out, out
    log = auto_daemon.log_text()[len(before) :]
    staged_lines = [line for line in log.splitlines() if "GPU outputs staged" in line]
    ipc_lines = [line for line in log.splitlines() if "GPU outputs by CUDA IPC" in line]
    # Which path CUDA allowed across namespaces is this test's finding: it says so.
    print("output path in another PID namespace:", (staged_lines or ipc_lines or ["?"])[0])
    assert len(staged_lines) + len(ipc_lines) == 1, log
    if staged_lines:
        assert "staged through shared memory" in out, out
