"""A shared pipeline on two DALI instances (pinned: ``dalid serve --instances 2``) in a real
daemon: every batch of several jobs comes back with DALI's outputs, a bad sample and a job
killed mid-run are handled as on one instance, ``dalid status`` says how many instances and
why, and once the jobs are gone nothing of the pipeline is left (threads, shared memory).

The controller's choice from measurements is unit-tested in tests/unit/test_instances.py.
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

import dalid.client as dalid
from dalid.protocol import PipelineStatus

from ..daemons import (
    DaemonProcess,
    kill_leftovers,
    module_daemon,
    start_daemon,
    start_job,
    wait_for,
)
from .helpers import run_in_process
from .test_bad_samples import as_array, encode
from .test_shared_pipelines import BATCH, _expected, _submit, decoding, scaling

STATUS = (sys.executable, "-m", "dalid.server", "status")
PINNED = "2 DALI instances: pinned by dalid serve --instances 2"


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _pipelines(daemon: DaemonProcess, name: str) -> list[PipelineStatus]:
    return [pipeline for pipeline in daemon.status().pipelines if pipeline.name == name]


@pytest.fixture(scope="module")
def two_instances() -> Iterator[DaemonProcess]:
    with module_daemon("--instances", "2", "--concurrency", "4") as running:
        yield running


def test_jobs_sharing_a_pipeline_on_two_instances_get_every_batch_as_dali_makes_it(
    two_instances: DaemonProcess,
) -> None:
    daemon_pid = two_instances.daemon_pid()
    before = _threads(daemon_pid)
    jobs = 3
    sessions = [
        dalid.connect(socket=two_instances.socket, autostart=False, name=f"job{j}")
        for j in range(jobs)
    ]
    try:
        proxies = [session.proxy(scaling()) for session in sessions]
        wait_for(
            lambda: _pipelines(two_instances, "scaling")[0].instances == 2,
            30,
            "the second instance",
        )
        (pipeline,) = _pipelines(two_instances, "scaling")
        assert pipeline.shared and pipeline.instances_reason == PINNED
        batches = 8
        refs = _submit(proxies, batches)
        # Out of order across instances is fine: each batch is asked for by its reference.
        for job, (session, job_refs) in enumerate(zip(sessions, refs, strict=True)):
            for number, ref in reversed(list(enumerate(job_refs))):
                blurred, shifted = session.produce_data(ref)
                want = _expected(job, number)
                np.testing.assert_allclose(blurred.numpy(), want[0], rtol=1e-6)
                np.testing.assert_array_equal(shifted.numpy(), want[1])
        (pipeline,) = _pipelines(two_instances, "scaling")
        assert pipeline.samples == batches * BATCH * jobs
        assert len(pipeline.instance_runs) == 2 and sum(pipeline.instance_runs) == pipeline.runs
        assert all(runs > 0 for runs in pipeline.instance_runs), pipeline.instance_runs
        # dalid status, as text and as JSON, says how many instances and why.
        text = subprocess.run(
            [*STATUS, "--socket", str(two_instances.socket)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "COLUMNS": "400"},
        ).stdout
        assert PINNED in text.replace("\n  ", " "), text
        out = subprocess.run(
            [*STATUS, "--json", "--socket", str(two_instances.socket)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (shown,) = [p for p in json.loads(out)["pipelines"] if p["name"] == "scaling"]
        assert shown["instances"] == 2 and shown["instances_reason"] == PINNED
    finally:
        for session in sessions:
            session.close()
    wait_for(lambda: not _pipelines(two_instances, "scaling"), 10, "the pipeline to go")
    # Both instances' threads (ours and DALI's) are gone with the pipeline.
    wait_for(lambda: _threads(daemon_pid) <= before, 10, "the pipeline's threads to end")


def test_a_bad_sample_on_two_instances_costs_another_job_nothing(
    two_instances: DaemonProcess,
) -> None:
    with (
        dalid.connect(socket=two_instances.socket, autostart=False) as bad_job,
        dalid.connect(socket=two_instances.socket, autostart=False) as good_job,
    ):
        bad_proxy = bad_job.proxy(decoding(), on_error="skip")
        good_proxy = good_job.proxy(decoding())
        wait_for(
            lambda: _pipelines(two_instances, "decoding")[0].instances == 2,
            30,
            "the second instance",
        )

        def batch(proxy: dalid.Proxy, indices: list[int], broken: Container[int] = ()) -> Any:
            samples = []
            for index in indices:
                jpeg = encode(index)
                samples.append(proxy(as_array(jpeg[: len(jpeg) // 3] if index in broken else jpeg)))
            return torch.utils.data.default_collate(samples)

        refs = []
        for number in range(6):
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
        (pipeline,) = _pipelines(two_instances, "decoding")
        assert pipeline.shared and len(pipeline.jobs) == 2 and pipeline.instances == 2
    wait_for(lambda: not _pipelines(two_instances, "decoding"), 10, "the pipeline to go")


def test_a_job_killed_mid_run_on_two_instances_leaves_the_other_job_whole(
    short_tmp: Path,
) -> None:
    daemon = start_daemon(short_tmp, "--instances", "2", "--concurrency", "4")
    jobs: list[subprocess.Popen[str]] = []
    try:
        for name in ("victim", "survivor"):
            args: tuple[str, ...] = ("--name", name, "--workers", "2", "--window", "31")
            if name == "survivor":
                args += ("--batches", "60")
            jobs.append(start_job("load_job", daemon.socket, *args))
        for job in jobs:
            assert job.stdout is not None
            assert job.stdout.readline().strip() == "running"
        wait_for(
            lambda: any(
                p.instances == 2 and all(p.instance_runs) for p in daemon.status().pipelines
            ),
            30,
            "runs on both instances",
        )
        victim, survivor = jobs
        os.kill(victim.pid, signal.SIGKILL)
        victim.communicate()
        # Not communicate(timeout=...): it reads the pipe itself, past what readline() above
        # already buffered, so an early "ok 60" would be lost. The output is a few lines.
        survivor.wait(timeout=300)
        assert survivor.stdout is not None
        with survivor.stdout:
            out = survivor.stdout.read()
        assert survivor.returncode == 0 and "ok 60" in out, out
        wait_for(lambda: not daemon.status().jobs, 10, "both jobs to end")
        assert not daemon.status().pipelines
    finally:
        kill_leftovers(jobs)
        assert daemon.stop() == 0
    assert not daemon.segments()


def _dali_pool_threads(pid: int) -> list[str]:
    """The names of DALI's pool threads in process ``pid`` ("[DALI][TP0]Exec", ...)."""
    names = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as comm:
                name = comm.read().strip()
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
        if name.startswith("[DALI][TP"):
            names.append(name)
    return sorted(names)


def test_a_cpu_daemon_starts_a_shared_pipeline_on_two_instances_of_half_its_threads(
    short_tmp: Path,
) -> None:
    # Note [Two instances on a CPU]: --threads 2 makes two instances of one DALI thread each,
    # as many threads as one instance of two, and every batch comes back as DALI makes it.
    daemon = start_daemon(short_tmp, "--threads", "2")
    try:
        with dalid.connect(socket=daemon.socket, autostart=False, name="split") as session:
            proxy = session.proxy(scaling())
            wait_for(lambda: _pipelines(daemon, "scaling")[0].instances == 2, 30, "two instances")
            (pipeline,) = _pipelines(daemon, "scaling")
            assert pipeline.threads == 1
            assert pipeline.instances_reason == (
                "2 DALI instances from the start, its threads split between them"
            )
            assert _dali_pool_threads(daemon.daemon_pid()) == ["[DALI][TP0]Exec"] * 2
            batches = 6
            (refs,) = _submit([proxy], batches)
            for number, ref in reversed(list(enumerate(refs))):
                blurred, shifted = session.produce_data(ref)
                want = _expected(0, number)
                np.testing.assert_allclose(blurred.numpy(), want[0], rtol=1e-6)
                np.testing.assert_array_equal(shifted.numpy(), want[1])
            (pipeline,) = _pipelines(daemon, "scaling")
            assert pipeline.samples == batches * BATCH
    finally:
        assert daemon.stop() == 0, daemon.log_text()


def test_a_pinned_count_on_a_cpu_daemon_keeps_every_instance_its_threads(
    short_tmp: Path,
) -> None:
    daemon = start_daemon(short_tmp, "--threads", "2", "--instances", "1")
    try:
        with dalid.connect(socket=daemon.socket, autostart=False, name="one") as session:
            session.proxy(scaling())
            (pipeline,) = _pipelines(daemon, "scaling")
            assert (pipeline.instances, pipeline.threads) == (1, 2)
            assert _dali_pool_threads(daemon.daemon_pid()) == ["[DALI][TP0]Exec", "[DALI][TP1]Exec"]
    finally:
        assert daemon.stop() == 0, daemon.log_text()
