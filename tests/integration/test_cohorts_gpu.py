"""A cohort on a GPU daemon: the members' batches of the same inputs run once, and the run's GPU
outputs are copied into each member's own GPU memory (the cohort's shared memory holds CPU
outputs only: Note [Cohort outputs], point 4). Skipped without CUDA."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import dalid.client as dalid

from ..daemons import DaemonProcess, own_directory, start_daemon
from .helpers import BATCH, gpu_pipeline, run_in_process, sample

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_daemon() -> Iterator[DaemonProcess]:
    directory = own_directory()
    daemon = start_daemon(directory, "--device", "0")
    try:
        yield daemon
    finally:
        code = daemon.stop()
        segments = daemon.segments()
        log = daemon.log_text()
        shutil.rmtree(directory, ignore_errors=True)
        assert code == 0, f"daemon exited with {code}:\n{log}"
        assert not segments


def test_members_on_a_gpu_daemon_share_the_run_and_get_their_own_copies(
    gpu_daemon: DaemonProcess,
) -> None:
    batches = 4
    with (
        dalid.connect(0, socket=gpu_daemon.socket, autostart=False, cohort="gpu") as first,
        dalid.connect(0, socket=gpu_daemon.socket, autostart=False, cohort="gpu") as second,
    ):
        proxies = [first.proxy(gpu_pipeline()), second.proxy(gpu_pipeline())]
        for number in range(batches):
            batch = [sample(number * BATCH + i) for i in range(BATCH)]
            want = run_in_process(gpu_pipeline(), [{"data": batch}])[0]
            refs = [
                torch.utils.data.default_collate([proxy(s) for s in batch]) for proxy in proxies
            ]
            for session, ref in zip((first, second), refs, strict=True):
                scaled, shifted = session.produce_data(ref)
                assert scaled.is_cuda and not shifted.is_cuda
                np.testing.assert_allclose(scaled.cpu().numpy(), want[0], rtol=1e-6)
                np.testing.assert_array_equal(shifted.numpy(), want[1])
                del scaled, shifted
        report = gpu_daemon.status()
        (cohort,) = [c for c in report.cohorts if c.name == "gpu"]
        # A batch that arrived before its twin had run was served a copy of that run; one that
        # arrived later ran again (nothing waits in the cohort's memory for GPU outputs).
        assert cohort.hits >= 1 and cohort.runs + cohort.hits == 2 * batches
        assert cohort.copied == cohort.runs
        (pipeline,) = [p for p in report.pipelines if first.job_id in p.jobs]
        assert pipeline.samples == cohort.runs * BATCH
