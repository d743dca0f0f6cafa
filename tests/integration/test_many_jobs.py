"""Many jobs on one daemon, as separate processes: data, fair shares, limits, status and metrics.

Jobs that die are in test_dead_jobs.py.
"""

from __future__ import annotations

import json
import os
import re
import socket as socketlib
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dalid.client as dalid
from dalid.client import RequestError
from dalid.protocol import ErrorCode, JobStatus
from dalid.server.operations.status_view import COLUMNS, job_row

from ..daemons import ROOT, DaemonProcess, kill_leftovers, start_daemon, start_job, wait_for
from .helpers import BATCH, ProxyDataset, two_output_pipeline
from .load_job import Images, heavy_pipeline

pytestmark = pytest.mark.slow


def _wait_running(job: subprocess.Popen[str]) -> None:
    assert job.stdout is not None
    line = job.stdout.readline()
    if line.strip() != "running":
        job.kill()
        raise AssertionError(f"the job did not start: {line}{job.communicate()[0]}")


def test_four_jobs_of_four_workers_each_get_their_own_data(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    jobs: list[subprocess.Popen[str]] = []
    try:
        for offset in (10, 20, 30, 40):
            # Each job starts its loader only once all four are connected.
            args = ("--offset", str(offset), "--workers", "4", "--length", "96", "--together", "4")
            jobs.append(start_job("trainer_job", daemon.socket, *args))
        outputs = [job.communicate(timeout=300)[0] for job in jobs]
        for job, out in zip(jobs, outputs, strict=True):
            assert job.returncode == 0, out
            assert "ok 96" in out
        wait_for(lambda: not daemon.status().jobs, 10, "every job to end")
    finally:
        kill_leftovers(jobs)
        assert daemon.stop() == 0
    assert not daemon.segments()


def _while_busy(
    daemon: DaemonProcess, jobs: list[subprocess.Popen[str]], windows: int = 3
) -> tuple[dict[str, JobStatus], dict[str, JobStatus], list[dict[str, int]]]:
    """Each job's status before and after 5 s in which the jobs keep the daemon busy, and the
    queue depths sampled meanwhile: they say whether every job kept batches queued (if one ran
    dry, its share measured its own clients, not the daemon's order). On a loaded machine a
    job's clients may fall behind for a while: up to ``windows`` windows are taken, and the
    first in which every job kept batches queued throughout is the one returned (else the
    last)."""
    for job in jobs:
        _wait_running(job)
    time.sleep(1.0)  # all backlogged from here on, and each pipeline's cost learnt
    for _ in range(windows):
        before = {job.name: job for job in daemon.status().jobs}
        backlog: list[dict[str, int]] = []
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            backlog.append({job.name: job.queued for job in daemon.status().jobs})
            time.sleep(0.25)
        after = {job.name: job for job in daemon.status().jobs}
        if all(queued > 0 for sample in backlog for queued in sample.values()):
            break
    return before, after, backlog


def test_busy_jobs_share_the_daemon_by_weight(short_tmp: Path) -> None:
    # One batch at a time, so the daemon's order decides everything.
    daemon = start_daemon(short_tmp, "--concurrency", "1")
    jobs: list[subprocess.Popen[str]] = []
    try:
        # Shares hold among jobs that keep the daemon busy. A wide blur makes a batch cost the
        # daemon far more than it costs a job's workers and trainer to send and check it, so
        # both jobs keep batches queued even on a small machine; the heavier job gets the
        # workers to keep three times as many coming.
        for name, weight, workers in (("light", "1", "2"), ("heavy", "3", "4")):
            jobs.append(
                start_job(
                    "load_job",
                    daemon.socket,
                    *("--name", name, "--weight", weight, "--workers", workers),
                    *("--window", "81"),
                )
            )
        before, after, backlog = _while_busy(daemon, jobs)
        light = after["light"].samples_done - before["light"].samples_done
        heavy = after["heavy"].samples_done - before["heavy"].samples_done
        assert light > 0 and heavy > 0
        # The same pipeline for both: shares of time are shares of samples.
        assert 2.0 <= heavy / light <= 4.5, (light, heavy, backlog)
        # ... and one pipeline in the daemon, whose runs mix both jobs' batches: the weights
        # hold inside shared runs.
        (pipeline,) = daemon.status().pipelines
        assert pipeline.shared and len(pipeline.jobs) == 2 and pipeline.mixed_runs > 0, pipeline
        for job in jobs:
            assert job.poll() is None, job.communicate()[0]
    finally:
        kill_leftovers(jobs)
        assert daemon.stop() == 0


def test_jobs_of_equal_weight_share_the_daemons_time_not_its_samples(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp, "--concurrency", "1")
    jobs: list[subprocess.Popen[str]] = []
    try:
        # The same images, batch and weight; a blur four times wider makes a heavy sample cost
        # the daemon several times a light one. Both blurs are wide enough that a light batch
        # costs the daemon far more than its trainer's check: with narrower ones (31 and 121) a
        # loaded machine slowed the light trainer's releases until its window, not the daemon's
        # order, set its share (0.58 of the heavy job's time).
        for name, window, workers in (("light", "61", "3"), ("heavy", "241", "2")):
            jobs.append(
                start_job(
                    "load_job",
                    daemon.socket,
                    *("--name", name, "--window", window, "--workers", workers),
                )
            )
        before, after, backlog = _while_busy(daemon, jobs)
        seconds = {n: after[n].run_seconds - before[n].run_seconds for n in after}
        samples = {n: after[n].samples_done - before[n].samples_done for n in after}
        # Equal shares of the daemon's time; so the light job gets several times the samples
        # (counting samples instead would give both the same number).
        assert 0.6 <= seconds["light"] / seconds["heavy"] <= 1.67, (seconds, samples, backlog)
        assert samples["light"] >= 2 * samples["heavy"], (seconds, samples, backlog)
        for job in jobs:
            assert job.poll() is None, job.communicate()[0]
    finally:
        kill_leftovers(jobs)
        assert daemon.stop() == 0


def test_a_steady_job_beside_flooding_ones_waits_only_for_running_batches(short_tmp: Path) -> None:
    # One DALI instance: the bound below counts the slots one instance's runs take.
    daemon = start_daemon(short_tmp, "--concurrency", "1", "--instances", "1")
    jobs: list[subprocess.Popen[str]] = []
    try:
        # Three jobs that keep large batches queued, and one that sends a small batch at a time.
        for name in ("flood1", "flood2", "flood3"):
            jobs.append(start_job("load_job", daemon.socket, "--name", name, "--batch", "32"))
        for job in jobs:
            _wait_running(job)
        steady = start_job(
            "load_job",
            daemon.socket,
            "--name",
            "steady",
            "--batch",
            "8",
            "--workers",
            "0",
            "--batches",
            "30",
        )
        jobs.append(steady)
        out, _ = steady.communicate(timeout=120)
        assert steady.returncode == 0, out
        assert "ok 30" in out
        # Its job is gone now; the floods ran all along.
        for flood in jobs[:3]:
            assert flood.poll() is None
        log = daemon.log_text()
        # The daemon logged what each job's batches waited for at its end.
        match = re.search(r"job \d+ \(steady\) ended: .* passed over (\d+) times", log)
        assert match is not None, log[-2000:]
        # First-come-first-served would put each steady batch behind the three floods' queued
        # batches; fair queueing starts it next, behind only the batch already running.
        assert int(match.group(1)) <= 30, log[-2000:]
    finally:
        kill_leftovers(jobs)
        assert daemon.stop() == 0


def test_jobs_over_the_daemon_limits_are_refused_at_connect(short_tmp: Path) -> None:
    daemon = start_daemon(
        short_tmp,
        "--max-jobs",
        "2",
        "--memory-limit",
        "3M",
        "--pool-bytes",
        "1M",
        "--max-inflight-batches",
        "4",
    )
    sessions: list[dalid.Session] = []

    def connect(**asks: Any) -> dalid.Session:
        session = dalid.connect(socket=daemon.socket, autostart=False, **asks)
        sessions.append(session)
        return session

    try:
        big = connect(memory_bytes=2 << 20)
        assert big.limits.pool_bytes == 2 << 20
        with pytest.raises(RequestError, match=r"asks for 2 MiB .* has 1 MiB left .* 3 MiB"):
            connect(memory_bytes=2 << 20)
        with pytest.raises(RequestError, match=r"at most 4 per job"):
            connect(max_inflight_batches=5)
        second = connect(max_inflight_batches=3, weight=2.5)
        assert second.limits.pool_bytes == 1 << 20  # the daemon's default
        assert second.limits.max_inflight_batches == 3
        assert second.limits.weight == 2.5
        with pytest.raises(RequestError, match=r"already serves 2 jobs.*--max-jobs 2"):
            connect()
        big.close()
        # The freed place and memory are there for the next job at once.
        third = connect(memory_bytes=2 << 20)
        assert third.limits.pool_bytes == 2 << 20
        report = daemon.status()
        # A job that asked for no amount has reserved nothing yet: it has run no batch.
        assert report.memory_reserved == 2 << 20
        assert report.memory_limit == 3 << 20
    finally:
        for session in sessions:
            session.close()
        assert daemon.stop() == 0


class BigSamples(torch.utils.data.Dataset[tuple[Any, int]]):
    """Samples of 1 MiB: a batch of 8 has 8 MiB in each of the two outputs."""

    def __init__(self, proxy: dalid.Proxy) -> None:
        self.proxy = proxy

    def __len__(self) -> int:
        return BATCH

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.proxy(np.full((256, 1024), index, np.int32)), index


def test_a_job_reserves_what_its_outputs_take_and_is_told_when_the_daemon_has_not_that_much(
    short_tmp: Path,
) -> None:
    daemon = start_daemon(short_tmp, "--memory-limit", "12M", "--slab-bytes", "1M")
    small = dalid.connect(socket=daemon.socket, autostart=False, name="small")
    big = dalid.connect(socket=daemon.socket, autostart=False, name="big")
    try:
        assert daemon.status().memory_reserved == 0  # connected jobs that ran nothing
        proxy = small.proxy(two_output_pipeline())
        batches = list(dalid.DataLoader(small, ProxyDataset(proxy, BATCH * 3), batch_size=BATCH))
        assert len(batches) == 3
        report = daemon.status()
        (job,) = [job for job in report.jobs if job.name == "small"]
        # A few pages for outputs of a few hundred bytes, not the --pool-bytes default.
        assert 0 < job.memory_bytes == report.memory_reserved <= 64 << 10
        big_proxy = big.proxy(two_output_pipeline())
        loader = dalid.DataLoader(big, BigSamples(big_proxy), batch_size=BATCH)
        with pytest.raises(RequestError) as refused:
            next(iter(loader))
        assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED
        message = str(refused.value)
        assert re.search(r"needs [\d.]+ MiB of output memory and this daemon has", message), message
        assert "of its --memory-limit 12 MiB" in message
        # The small job goes on.
        assert list(dalid.DataLoader(small, ProxyDataset(proxy, BATCH), batch_size=BATCH))
    finally:
        small.close()
        big.close()
        assert daemon.stop() == 0


def test_sixty_four_small_jobs_fit_on_the_defaults(short_tmp: Path) -> None:
    # The defaults: --max-jobs 64, --memory-limit the size of /dev/shm, 8 jobs per process.
    daemon = start_daemon(short_tmp)
    jobs: list[subprocess.Popen[str]] = []
    try:
        for _ in range(8):
            command = [sys.executable, "-m", "tests.integration.small_jobs", "--jobs", "8"]
            job = subprocess.Popen(
                [*command, "--socket", str(daemon.socket)],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            jobs.append(job)
        for job in jobs:
            _wait_ready(job)
        report = daemon.status()
        assert len(report.jobs) == 64
        assert all(job.batches_done == 1 for job in report.jobs)
        # Each reserved what its outputs took: a few pages, not a GiB.
        assert report.memory_reserved <= 64 * (64 << 10), report.memory_reserved
        with pytest.raises(RequestError, match=r"already serves 64 jobs.*--max-jobs 64"):
            dalid.connect(socket=daemon.socket, autostart=False)
        for job in jobs:
            out, _ = job.communicate("\n", timeout=120)
            assert job.returncode == 0 and out.strip().endswith("ok"), out
        wait_for(lambda: not daemon.status().jobs, 30, "every job to end")
    finally:
        kill_leftovers(jobs)
        assert daemon.stop() == 0
    assert not daemon.segments()


def _wait_ready(job: subprocess.Popen[str]) -> None:
    assert job.stdout is not None
    line = job.stdout.readline()
    if line.strip() != "ready":
        job.kill()
        raise AssertionError(f"the jobs did not start: {line}{job.communicate()[0]}")


def test_backpressure_holds_a_job_to_its_own_inflight_limit(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp, "--concurrency", "1")
    session = dalid.connect(socket=daemon.socket, autostart=False, max_inflight_batches=1)
    samples: list[tuple[int, int]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for status in daemon.status().jobs:
                samples.append((status.queued + status.running, status.waiting))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    try:
        # Four workers make batches faster than the daemon runs the heavy pipeline.
        proxy = session.proxy(heavy_pipeline(BATCH))
        loader = dalid.DataLoader(
            session, Images(proxy, BATCH * 30), batch_size=BATCH, num_workers=4, prefetch_factor=4
        )
        watcher.start()
        seen = 0
        for (blurred, _), indices in loader:
            expected = (indices % 251).to(torch.uint8).view(-1, 1, 1, 1)
            assert torch.equal(blurred, expected.expand_as(blurred))
            seen += len(indices)
        assert seen == BATCH * 30
    finally:
        done.set()
        if watcher.is_alive():
            watcher.join()
        session.close()
        assert daemon.stop() == 0
    assert samples
    # Its limit, and the batch its trainer waits for past it by one (SPEC.md, "Batches in
    # flight"): the workers' other batches waited.
    assert max(inflight for inflight, _ in samples) <= 1 + 1
    assert max(waiting for _, waiting in samples) >= 1, "the workers' batches never had to wait"


def test_status_command_prints_the_jobs_as_a_table_and_as_json(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    session = dalid.connect(socket=daemon.socket, autostart=False, name="resnet-7", weight=2)
    try:
        proxy = session.proxy(two_output_pipeline())
        loader = dalid.DataLoader(session, ProxyDataset(proxy, BATCH * 3), batch_size=BATCH)
        batches = list(loader)
        assert len(batches) == 3
        command = [sys.executable, "-m", "dalid.server", "status", "--socket", str(daemon.socket)]
        as_json = subprocess.run([*command, "--json"], capture_output=True, text=True, check=True)
        report = json.loads(as_json.stdout)
        assert report["daemon_pid"] == daemon.pid
        (job,) = report["jobs"]
        assert job["name"] == "resnet-7"
        assert job["weight"] == 2
        assert job["pipelines"] == 1
        assert job["batches_done"] == 3 and job["samples_done"] == 3 * BATCH
        # The loader's batches are alive here: the job holds their buffers.
        assert job["regions_held"] == 6 and job["bytes_held"] > 0
        assert job["trainer_wait_seconds"] > 0
        table = subprocess.run([*command, "--once"], capture_output=True, text=True, check=True)
        assert f"daemon pid {daemon.pid}" in table.stdout
        assert "resnet-7" in table.stdout and "samples/s" in table.stdout
        # Into a pipe, COLUMNS sets the width: every line fits, the essential columns stay.
        narrow = subprocess.run(
            [*command, "--once"],
            env={**os.environ, "COLUMNS": "80"},
            capture_output=True,
            text=True,
            check=True,
        )
        assert max(len(line) for line in narrow.stdout.splitlines()) <= 80, narrow.stdout
        assert "samples/s" in narrow.stdout and "not shown:" in narrow.stdout
        assert "DALI pipeline" in narrow.stdout
    finally:
        session.close()
        assert daemon.stop() == 0
    gone = subprocess.run(
        [sys.executable, "-m", "dalid.server", "status", "--socket", str(daemon.socket)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert gone.returncode == 1
    assert "no dalid daemon listens" in gone.stderr
    assert f"start one with `dalid serve --device cpu --socket {daemon.socket}`" in gone.stderr


def test_the_first_status_after_a_loader_starts_counts_its_workers(short_tmp: Path) -> None:
    """A loader's workers connect at their first sample; the status counts them from the
    moment its iterator starts them, and an epoch's workers no longer once the epoch ends."""
    daemon = start_daemon(short_tmp)
    session = dalid.connect(socket=daemon.socket, autostart=False, name="starting")
    try:
        proxy = session.proxy(two_output_pipeline())
        loader = dalid.DataLoader(
            session, ProxyDataset(proxy, BATCH * 4), batch_size=BATCH, num_workers=2
        )
        (job,) = daemon.status().jobs
        assert job.workers == 0 and job.workers_started is None
        iterator = iter(loader)
        (job,) = daemon.status().jobs
        assert job.workers_started == 2
        assert job_row(job)[[c.header for c in COLUMNS].index("workers")].startswith("2")
        # As the table prints it, in another process.
        command = [sys.executable, "-m", "dalid.server", "status", "--socket", str(daemon.socket)]
        as_json = subprocess.run([*command, "--json"], capture_output=True, text=True, check=True)
        assert json.loads(as_json.stdout)["jobs"][0]["workers_started"] == 2
        assert len(list(iterator)) == 4
        # The epoch's workers stopped with it (they were not persistent).
        (job,) = daemon.status().jobs
        assert job.workers_started == 0
        del iterator
    finally:
        session.close()
        assert daemon.stop() == 0


def _free_port() -> int:
    with socketlib.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_metrics_endpoint_serves_the_status_figures(short_tmp: Path) -> None:
    port = _free_port()
    daemon = start_daemon(short_tmp, "--metrics-port", str(port))
    session = dalid.connect(socket=daemon.socket, autostart=False, name="metrics-job")
    try:
        proxy = session.proxy(two_output_pipeline())
        loader = dalid.DataLoader(session, ProxyDataset(proxy, BATCH * 2), batch_size=BATCH)
        assert len(list(loader)) == 2

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                body: bytes = reply.read()
                return body.decode()

        labels = 'device="cpu",job="1",name="metrics-job"'
        # The endpoint serves a snapshot that the daemon refreshes every second.
        wait_for(
            lambda: f"dalid_job_samples_total{{{labels}}} {2.0 * BATCH}" in scrape(),
            10,
            "the job's samples in the metrics",
        )
        text = scrape()
        assert 'dalid_jobs{device="cpu"} 1.0' in text
        assert f"dalid_job_batches_total{{{labels}}} 2.0" in text
        pipeline = 'device="cpu",name="two_output_pipeline",pipeline="1",shared="True"'
        assert f"dalid_pipeline_samples_total{{{pipeline}}} {2.0 * BATCH}" in text
        assert f"dalid_pipeline_jobs{{{pipeline}}} 1.0" in text
        # A CPU daemon's shared pipeline runs on two DALI instances (dali-instances.md).
        assert f"dalid_pipeline_instances{{{pipeline}}} 2.0" in text
        assert "job_token" not in text and "dalid-" not in text  # no secrets, no buffer names
        # DataLoader workers: those connected (the loader above, without workers, submitted
        # from the trainer's process, which connected as its one worker) and those its trainer
        # says its loaders started, with no series until it says; `dalid status`: "2 (1 joined)".
        assert f"dalid_job_workers{{{labels}}} 1.0" in text
        assert "dalid_job_workers_started{" not in text
        session.started_workers.start(2)
        session.tell_workers()
        wait_for(
            lambda: f"dalid_job_workers_started{{{labels}}} 2.0" in scrape(),
            10,
            "the workers the trainer started in the metrics",
        )
        assert f"dalid_job_workers{{{labels}}} 1.0" in scrape()
    finally:
        session.close()
        assert daemon.stop() == 0
