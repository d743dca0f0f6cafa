"""A cohort on a GPU daemon: the members' batches of the same inputs run once, and every member
maps the same region of the cohort's GPU memory by CUDA IPC, with no copy (Note [Cohort
outputs] in cohorts.py). Skipped without CUDA; the same on a simulated GPU, with a member
without IPC and one killed: tests/integration/test_cohorts_simulated_gpu.py."""

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


def test_members_on_a_gpu_daemon_map_one_region_of_one_run_with_no_copy(
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
            produced = [
                session.produce_data(ref)
                for session, ref in zip((first, second), refs, strict=True)
            ]
            for scaled, shifted in produced:
                assert scaled.is_cuda and not shifted.is_cuda
                np.testing.assert_allclose(scaled.cpu().numpy(), want[0], rtol=1e-6)
                np.testing.assert_array_equal(shifted.numpy(), want[1])
            # Both members' trainers (one process here) opened the same slab by its handle:
            # CUDA returns the one mapping, so one region of one run has one address.
            assert produced[0][0].data_ptr() == produced[1][0].data_ptr()
            del produced, scaled, shifted
        report = gpu_daemon.status()
        (cohort,) = [c for c in report.cohorts if c.name == "gpu"]
        assert (cohort.runs, cohort.hits, cohort.copied) == (batches, batches, 0)
        assert cohort.device_bytes > 0
        jobs = {job.job_id: job for job in report.jobs}
        for session in (first, second):
            assert jobs[session.job_id].output_path == "cuda_ipc"
            assert jobs[session.job_id].batches_copied == 0
        (pipeline,) = [p for p in report.pipelines if first.job_id in p.jobs]
        assert pipeline.samples == batches * BATCH
