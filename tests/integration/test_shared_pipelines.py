"""Jobs that register the same pipeline share one DALI pipeline in a real daemon, and its runs
mix their samples; each job's outputs, bad samples and death stay its own.

The daemon runs one batch of runs at a time (``--concurrency 1``): while a run is inside DALI
the next batches of every job queue up, so the runs after it hold batches of several jobs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Container, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode

import dalid.client as dalid
from dalid.protocol import PipelineStatus, StatusReport

from ..daemons import (
    DaemonProcess,
    kill_leftovers,
    module_daemon,
    start_daemon,
    start_job,
    wait_for,
)
from ..dali_typing import pipeline_def
from .helpers import BATCH as HELPER_BATCH
from .helpers import ProxyDataset, run_in_process, two_output_pipeline
from .helpers import sample as helper_sample
from .test_bad_samples import as_array, encode

BATCH = 8
SIDE = 24
STATUS = (sys.executable, "-m", "dalid.server", "status", "--json")


@pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, seed=11)
def scaling() -> tuple[DataNode, DataNode]:
    """Per-sample, no random operator: a job's outputs are the same in any run. The blur makes
    a run take long enough for the next batches of every job to queue up meanwhile."""
    data = fn.external_source(name="data", no_copy=True)
    blurred = fn.gaussian_blur(
        fn.cast(data, dtype=types.DALIDataType.FLOAT), window_size=31, sigma=6.0
    )
    return blurred * 0.5 + 1.0, data + 7


@pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, seed=11)
def permuting() -> DataNode:
    """Looks across the batch: never shared."""
    data = fn.external_source(name="data", no_copy=True)
    return fn.permute_batch(data, indices=fn.batch_permutation())


@pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, seed=3)
def decoding() -> DataNode:
    jpegs = fn.external_source(name="jpegs", no_copy=True)
    images = fn.decoders.image(jpegs, device="cpu", output_type=types.DALIImageType.RGB)
    return fn.resize(images, resize_x=SIDE, resize_y=SIDE)  # type: ignore[return-value]


def data(job: int, index: int) -> np.ndarray:
    """A sample whose values name its job and index (a ramp, so that a blur changes it)."""
    ramp = np.arange(96, dtype=np.uint8).reshape(96, 1, 1) % 50
    return np.broadcast_to(ramp + job * 50 + index % 50, (96, 96, 1)).copy()


@pytest.fixture(scope="module")
def daemon_one_run() -> Iterator[DaemonProcess]:
    with module_daemon("--concurrency", "1") as running:
        yield running


def _submit(proxies: list[dalid.Proxy], batches: int) -> list[list[Any]]:
    """Submits ``batches`` batches of each job's samples through its proxy, as a DataLoader's
    collation does, the jobs' batches in turn; their references, by job."""
    refs: list[list[Any]] = [[] for _ in proxies]
    for number in range(batches):
        for job, proxy in enumerate(proxies):
            samples = [proxy(data(job, number * BATCH + i)) for i in range(BATCH)]
            refs[job].append(torch.utils.data.default_collate(samples))
    return refs


def _expected(job: int, number: int) -> list[np.ndarray]:
    batch = [data(job, number * BATCH + i) for i in range(BATCH)]
    return run_in_process(scaling(), [{"data": batch}])[0]


def _pipelines(daemon: DaemonProcess, name: str) -> list[PipelineStatus]:
    report: StatusReport = daemon.status()
    return [pipeline for pipeline in report.pipelines if pipeline.name == name]


@pytest.mark.parametrize("jobs", [2, 4])
def test_jobs_with_the_same_pipeline_share_one_and_get_their_own_outputs(
    daemon_one_run: DaemonProcess, jobs: int
) -> None:
    sessions = [
        dalid.connect(socket=daemon_one_run.socket, autostart=False, name=f"job{j}")
        for j in range(jobs)
    ]
    try:
        proxies = [session.proxy(scaling()) for session in sessions]
        (pipeline,) = _pipelines(daemon_one_run, "scaling")
        assert pipeline.shared and sorted(pipeline.jobs) == sorted(s.job_id for s in sessions)
        refs = _submit(proxies, 6)
        for job, (session, job_refs) in enumerate(zip(sessions, refs, strict=True)):
            for number, ref in enumerate(job_refs):
                blurred, shifted = session.produce_data(ref)
                want = _expected(job, number)
                np.testing.assert_allclose(blurred.numpy(), want[0], rtol=1e-6)
                np.testing.assert_array_equal(shifted.numpy(), want[1])
        (pipeline,) = _pipelines(daemon_one_run, "scaling")
        assert pipeline.mixed_runs > 0, pipeline
        assert pipeline.run_size == 4 * BATCH
        assert pipeline.samples == 6 * BATCH * jobs
    finally:
        for session in sessions:
            session.close()
    wait_for(lambda: not _pipelines(daemon_one_run, "scaling"), 10, "the pipeline to go")


def test_a_job_alone_gets_runs_that_are_its_batches(daemon_one_run: DaemonProcess) -> None:
    # Its six batches queue up behind the first run; each still runs alone, as DALI's proxy
    # runs it, and equals the pipeline run directly on the same batch.
    with dalid.connect(socket=daemon_one_run.socket, autostart=False) as session:
        proxy = session.proxy(scaling())
        (refs,) = _submit([proxy], 6)
        for number, ref in enumerate(refs):
            blurred, shifted = session.produce_data(ref)
            want = _expected(0, number)
            np.testing.assert_array_equal(blurred.numpy(), want[0])
            np.testing.assert_array_equal(shifted.numpy(), want[1])
        (pipeline,) = _pipelines(daemon_one_run, "scaling")
        assert pipeline.shared and pipeline.run_size == 4 * BATCH
        assert (pipeline.runs, pipeline.samples, pipeline.mixed_runs) == (6, 6 * BATCH, 0)
    wait_for(lambda: not _pipelines(daemon_one_run, "scaling"), 10, "the pipeline to go")


@pytest.mark.parametrize(("batch", "run_size"), [(128, 256), (300, 300)])
def test_runs_of_a_shared_pipeline_hold_256_samples_or_one_larger_batch(
    daemon_one_run: DaemonProcess, batch: int, run_size: int
) -> None:
    # --run-batches auto: DALI keeps buffers for the largest run it has seen, so runs of
    # large batches are not merged into larger ones, whatever the number of jobs.
    @pipeline_def(batch_size=batch, num_threads=1, device_id=None, seed=5)
    def plus_one() -> DataNode:
        return fn.external_source(name="data", no_copy=True) + 1

    sessions = [
        dalid.connect(socket=daemon_one_run.socket, autostart=False, name=f"job{j}")
        for j in range(2)
    ]
    try:
        for job, session in enumerate(sessions):
            proxy = session.proxy(plus_one())
            ref = torch.utils.data.default_collate(
                [proxy(np.full(3, job + i % 7, np.int32)) for i in range(batch)]
            )
            out = session.produce_data(ref)
            assert [row.tolist() for row in out] == [[job + i % 7 + 1] * 3 for i in range(batch)]
        (pipeline,) = _pipelines(daemon_one_run, "plus_one")
        assert pipeline.shared and sorted(pipeline.jobs) == sorted(s.job_id for s in sessions)
        assert pipeline.run_size == run_size
    finally:
        for session in sessions:
            session.close()
    wait_for(lambda: not _pipelines(daemon_one_run, "plus_one"), 10, "the pipeline to go")


def test_a_job_that_asks_for_runs_of_its_own_never_shares_one(
    daemon_one_run: DaemonProcess,
) -> None:
    with (
        dalid.connect(socket=daemon_one_run.socket, autostart=False, name="own") as own,
        dalid.connect(socket=daemon_one_run.socket, autostart=False, name="a") as first,
        dalid.connect(socket=daemon_one_run.socket, autostart=False, name="b") as second,
    ):
        proxies = [
            own.proxy(scaling(), share_runs=False),
            first.proxy(scaling()),
            second.proxy(scaling()),
        ]
        refs = _submit(proxies, 4)
        for job, (session, job_refs) in enumerate(zip((own, first, second), refs, strict=True)):
            for number, ref in enumerate(job_refs):
                blurred, shifted = session.produce_data(ref)
                want = _expected(job, number)
                np.testing.assert_allclose(blurred.numpy(), want[0], rtol=1e-6)
                np.testing.assert_array_equal(shifted.numpy(), want[1])
        found = {p.jobs: p for p in _pipelines(daemon_one_run, "scaling")}
        private = found[(own.job_id,)]
        assert not private.shared and "share_runs=False" in private.private_reason
        assert private.run_size == BATCH
        assert (private.runs, private.mixed_runs) == (4, 0)
        shared = found[tuple(sorted((first.job_id, second.job_id)))]
        assert shared.shared and shared.mixed_runs > 0
    wait_for(lambda: not _pipelines(daemon_one_run, "scaling"), 10, "the pipelines to go")


def test_status_json_shows_which_jobs_share_a_pipeline(daemon_one_run: DaemonProcess) -> None:
    with (
        dalid.connect(socket=daemon_one_run.socket, autostart=False) as first,
        dalid.connect(socket=daemon_one_run.socket, autostart=False) as second,
    ):
        first.proxy(scaling())
        second.proxy(scaling())
        out = subprocess.run(
            [*STATUS, "--socket", str(daemon_one_run.socket)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (pipeline,) = [p for p in json.loads(out)["pipelines"] if p["name"] == "scaling"]
        assert pipeline["shared"] is True
        assert sorted(pipeline["jobs"]) == sorted([first.job_id, second.job_id])


def test_a_pipeline_that_looks_across_the_batch_is_not_shared(
    daemon_one_run: DaemonProcess,
) -> None:
    with (
        dalid.connect(socket=daemon_one_run.socket, autostart=False) as first,
        dalid.connect(socket=daemon_one_run.socket, autostart=False) as second,
    ):
        first.proxy(permuting())
        second.proxy(permuting())
        found = _pipelines(daemon_one_run, "permuting")
        assert len(found) == 2
        for pipeline in found:
            assert not pipeline.shared and len(pipeline.jobs) == 1
            assert "BatchPermutation" in pipeline.private_reason


def test_a_deterministic_pipeline_is_not_shared(daemon_one_run: DaemonProcess) -> None:
    with (
        dalid.connect(socket=daemon_one_run.socket, autostart=False) as first,
        dalid.connect(socket=daemon_one_run.socket, autostart=False) as second,
    ):
        first.proxy(scaling(), deterministic=True)
        second.proxy(scaling())
        found = _pipelines(daemon_one_run, "scaling")
        assert len(found) == 2
        (private,) = [pipeline for pipeline in found if not pipeline.shared]
        assert private.jobs == (first.job_id,) and "deterministic" in private.private_reason


def test_a_bad_sample_of_one_job_costs_another_job_nothing_in_a_shared_run(
    daemon_one_run: DaemonProcess,
) -> None:
    with (
        dalid.connect(socket=daemon_one_run.socket, autostart=False) as bad_job,
        dalid.connect(socket=daemon_one_run.socket, autostart=False) as good_job,
    ):
        bad_proxy = bad_job.proxy(decoding(), on_error="skip")
        good_proxy = good_job.proxy(decoding())

        def batch(proxy: dalid.Proxy, indices: list[int], broken: Container[int] = ()) -> Any:
            samples = []
            for index in indices:
                jpeg = encode(index)
                samples.append(proxy(as_array(jpeg[: len(jpeg) // 3] if index in broken else jpeg)))
            return torch.utils.data.default_collate(samples)

        # Interleaved, so that runs hold batches of both jobs.
        refs = []
        for number in range(4):
            indices = list(range(number * BATCH, (number + 1) * BATCH))
            refs.append(("bad", indices, batch(bad_proxy, indices, broken={indices[2]})))
            refs.append(("good", indices, batch(good_proxy, indices)))
        for kind, indices, ref in refs:
            session = bad_job if kind == "bad" else good_job
            images = session.produce_data(ref)
            kept = [i for i in indices if kind == "good" or i != indices[2]]
            want = run_in_process(decoding(), [{"jpegs": [as_array(encode(i)) for i in kept]}])
            np.testing.assert_array_equal(images.numpy(), want[0][0])
            if kind == "good":
                assert good_job.last_bad_samples == []
            else:
                assert [bad.position for bad in bad_job.last_bad_samples] == [2]
        (pipeline,) = _pipelines(daemon_one_run, "decoding")
        assert pipeline.shared and len(pipeline.jobs) == 2


def test_a_job_killed_while_its_samples_share_runs_leaves_the_other_job_whole(
    short_tmp: Path,
) -> None:
    daemon = start_daemon(short_tmp, "--concurrency", "1")
    jobs: list[subprocess.Popen[str]] = []
    try:
        # Two jobs of the same heavy pipeline, both keeping the daemon busy.
        for name in ("victim", "survivor"):
            args: tuple[str, ...] = ("--name", name, "--workers", "2", "--window", "31")
            if name == "survivor":
                args += ("--batches", "60")
            jobs.append(start_job("load_job", daemon.socket, *args))
        for job in jobs:
            assert job.stdout is not None
            assert job.stdout.readline().strip() == "running"
        wait_for(
            lambda: any(p.mixed_runs > 0 for p in daemon.status().pipelines),
            30,
            "runs that hold batches of both jobs",
        )
        victim, survivor = jobs
        os.kill(victim.pid, signal.SIGKILL)
        victim.communicate()
        out, _ = survivor.communicate(timeout=300)
        assert survivor.returncode == 0 and "ok 60" in out, out
        wait_for(lambda: not daemon.status().jobs, 10, "both jobs to end")
        assert not daemon.status().pipelines
    finally:
        kill_leftovers(jobs)
        assert daemon.stop() == 0
    assert not daemon.segments()


def test_a_job_that_keeps_its_outputs_holds_up_no_other_job_of_its_pipeline(
    short_tmp: Path,
) -> None:
    # 8 KiB of output memory a job: the keeper holds it all after a few batches.
    daemon = start_daemon(short_tmp, "--pool-bytes", "8K", "--slab-bytes", "4K")
    try:
        with (
            dalid.connect(socket=daemon.socket, autostart=False, name="keeper") as keeper,
            dalid.connect(socket=daemon.socket, autostart=False, name="steady") as steady,
        ):
            proxies = [keeper.proxy(two_output_pipeline()), steady.proxy(two_output_pipeline())]
            loaders = [
                dalid.DataLoader(
                    session, ProxyDataset(proxy, 12 * HELPER_BATCH), batch_size=HELPER_BATCH
                )
                for session, proxy in zip((keeper, steady), proxies, strict=True)
            ]
            kept = []
            for kept_batch, steady_batch in zip(*loaders, strict=True):
                kept.append(kept_batch)  # the keeper never lets go
                (_, shifted), indices = steady_batch
                np.testing.assert_array_equal(
                    shifted[0].numpy(), helper_sample(int(indices[0])) + 7
                )
            for (_, shifted), indices in kept:
                np.testing.assert_array_equal(
                    shifted[0].numpy(), helper_sample(int(indices[0])) + 7
                )
            (pipeline,) = daemon.status().pipelines
            assert pipeline.shared and len(pipeline.jobs) == 2
            jobs = {job.name: job for job in daemon.status().jobs}
            assert jobs["keeper"].batches_copied > 0
            assert jobs["steady"].batches_copied == 0
    finally:
        assert daemon.stop() == 0
