"""Idle jobs reclaimed: a new job that finds the daemon full is welcomed once a job it competes
with has been idle for ``--reclaim-idle-s``, and that job's trainer is told why; a busy job is
never ended, two jobs idling in turn take the place in turn rather than evicting each other at
once, and with reclaiming off the refusal stays as it was (``dalid.server.jobs.reclaim``)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dalid.client as dalid
from dalid.client import JobEnded, RequestError

from ..daemons import DaemonProcess, start_daemon
from .helpers import BATCH, ProxyDataset, sample, two_output_pipeline

# Long enough that the steps of a test between two activities of a job never reach it.
IDLE_S = 2.0


@pytest.fixture
def sessions() -> Iterator[list[dalid.Session]]:
    opened: list[dalid.Session] = []
    yield opened
    for session in opened:
        session.close()


def _connect(daemon: DaemonProcess, opened: list[dalid.Session], **options: Any) -> dalid.Session:
    session = dalid.connect(socket=daemon.socket, autostart=False, **options)
    opened.append(session)
    return session


def _run(session: dalid.Session, proxy: Any, offset: int = 0) -> None:
    """One batch through ``proxy``, its outputs checked."""
    refs = torch.utils.data.default_collate([proxy(sample(i, offset)) for i in range(BATCH)])
    _, shifted = session.produce_data(refs)
    for row in range(BATCH):
        np.testing.assert_array_equal(shifted[row].numpy(), sample(row, offset) + 7)


def _stopped_clean(daemon: DaemonProcess) -> str:
    log = daemon.log_text()
    assert daemon.stop() == 0, log
    assert not daemon.segments()
    return log


def test_a_new_job_ends_the_job_idle_longest_never_a_busy_one(
    short_tmp: Path, sessions: list[dalid.Session]
) -> None:
    daemon = start_daemon(short_tmp, "--max-jobs", "4", "--reclaim-idle-s", f"{IDLE_S:g}")
    try:
        busy = _connect(daemon, sessions, name="busy")
        busy_proxy = busy.proxy(two_output_pipeline())
        idle = [_connect(daemon, sessions, name=f"idle {n}") for n in range(3)]
        # Not idle long enough: refused as before, saying so.
        with pytest.raises(RequestError, match=r"already serves 4 jobs.*none of the jobs"):
            _connect(daemon, sessions, name="too early")
        # The busy job, connected first, runs batches while the others idle past the limit.
        deadline = time.monotonic() + IDLE_S + 0.5
        while time.monotonic() < deadline:
            _run(busy, busy_proxy)
            time.sleep(0.1)
        newcomer = _connect(daemon, sessions, name="newcomer")
        # The first idle job, idle longest, made room; the busy one goes on.
        live = {job.job_id for job in daemon.status().jobs}
        assert live == {busy.job_id, idle[1].job_id, idle[2].job_id, newcomer.job_id}
        _run(busy, busy_proxy)
        # Its trainer learns why at its next call, as data.
        with pytest.raises(JobEnded) as raised:
            idle[0].proxy(two_output_pipeline())
        message = str(raised.value)
        assert re.search(r"job \d+ was ended after \d+ s idle, to make room for a new job", message)
        assert "the daemon is full: this daemon already serves 4 jobs" in message
        assert "--reclaim-idle-s" in message
        newcomer_proxy = newcomer.proxy(two_output_pipeline())
        _run(newcomer, newcomer_proxy)
    finally:
        log = _stopped_clean(daemon)
    assert log.count("reclaimed after") == 1, log


def test_two_jobs_idling_in_turn_take_the_place_in_turn_not_at_once(
    short_tmp: Path, sessions: list[dalid.Session]
) -> None:
    """With reconnect=True an ended job connects again at its next batch, as a new job: it ends
    the job now holding the place only once that one has been idle as long, so a job that comes
    back at once is refused rather than ending the job that just ended it."""
    daemon = start_daemon(short_tmp, "--max-jobs", "1", "--reclaim-idle-s", f"{IDLE_S:g}")
    try:
        first = _connect(daemon, sessions, name="first", reconnect=True)
        first_proxy = first.proxy(two_output_pipeline())
        _run(first, first_proxy)
        time.sleep(IDLE_S + 0.3)
        second = _connect(daemon, sessions, name="second", reconnect=True)
        second_proxy = second.proxy(two_output_pipeline())
        _run(second, second_proxy)
        time.sleep(IDLE_S + 0.3)
        # The first job's next batch: its job was ended, it connects again, and the second,
        # idle past the limit by now, makes room; the batch is served by the new job.
        _run(first, first_proxy, offset=1)
        assert first.reconnects == 1
        assert [job.job_id for job in daemon.status().jobs] == [first.job_id]
        # The second comes back at once: the first was active a moment ago, so it stays.
        with pytest.raises(RequestError, match=r"already serves 1 jobs.*none of the jobs"):
            _run(second, second_proxy, offset=2)
        _run(first, first_proxy, offset=3)
        assert [job.job_id for job in daemon.status().jobs] == [first.job_id]
    finally:
        log = _stopped_clean(daemon)
    assert log.count("reclaimed after") == 2, log


def test_with_reclaiming_off_a_full_daemon_refuses_as_before(
    short_tmp: Path, sessions: list[dalid.Session]
) -> None:
    daemon = start_daemon(short_tmp, "--max-jobs", "1", "--reclaim-idle-s", "0")
    try:
        _connect(daemon, sessions, name="idle")
        time.sleep(0.5)
        with pytest.raises(RequestError) as raised:
            _connect(daemon, sessions, name="newcomer")
        assert str(raised.value).endswith(
            "this daemon already serves 1 jobs, its limit (dalid serve --max-jobs 1): wait for "
            "one to end, or start the daemon with a higher limit"
        )
    finally:
        log = _stopped_clean(daemon)
    assert "reclaimed" not in log


def test_a_job_ended_before_its_first_batch_is_told_why_in_each_of_its_processes(
    short_tmp: Path, sessions: list[dalid.Session]
) -> None:
    """Its first batch is its first word since the end: a worker's hello, in the trainer's own
    process or in a DataLoader worker, is refused with the daemon's reason, raised as
    ``JobEnded`` (it used to be a RequestError ``unknown_job``)."""
    daemon = start_daemon(short_tmp, "--max-jobs", "1", "--reclaim-idle-s", f"{IDLE_S:g}")
    try:
        ended = _connect(daemon, sessions, name="ended")
        proxy = ended.proxy(two_output_pipeline())
        time.sleep(IDLE_S + 0.3)
        _connect(daemon, sessions, name="newcomer")
        reason = r"ended this job: job \d+ was ended after \d+ s idle, to make room for a new job"
        with pytest.raises(JobEnded, match=reason):
            _run(ended, proxy)
        loader = dalid.DataLoader(
            ended, ProxyDataset(proxy, BATCH), batch_size=BATCH, num_workers=1
        )
        with pytest.raises(JobEnded, match=reason):
            next(iter(loader))
    finally:
        log = _stopped_clean(daemon)
    assert log.count("reclaimed after") == 1, log


# --- a new pipeline that a full limit of pipelines or DALI threads refuses --------------------


def test_a_new_pipeline_ends_the_job_idle_longest_holding_one_never_a_busy_one(
    short_tmp: Path, sessions: list[dalid.Session]
) -> None:
    """A busy job's pipeline and an idle job's fill --max-daemon-pipelines 2: a third job
    starts its pipeline once the idle one has been idle long enough, ending that job."""
    daemon = start_daemon(
        short_tmp,
        "--max-daemon-pipelines",
        "2",
        "--share-pipelines",
        "no",
        "--reclaim-idle-s",
        f"{IDLE_S:g}",
    )
    try:
        busy = _connect(daemon, sessions, name="busy")
        busy_proxy = busy.proxy(two_output_pipeline())
        idle = _connect(daemon, sessions, name="idle")
        _run(idle, idle.proxy(two_output_pipeline()))
        newcomer = _connect(daemon, sessions, name="newcomer")
        # Not idle long enough: refused as before, saying so.
        with pytest.raises(RequestError, match=r"the daemon runs 2 pipelines.*none of the jobs"):
            newcomer.proxy(two_output_pipeline())
        deadline = time.monotonic() + IDLE_S + 0.5
        while time.monotonic() < deadline:
            _run(busy, busy_proxy)
            time.sleep(0.1)
        # The idle job made room; the busy one (and the newcomer, connected) go on.
        newcomer_proxy = newcomer.proxy(two_output_pipeline())
        _run(newcomer, newcomer_proxy)
        assert {job.job_id for job in daemon.status().jobs} == {busy.job_id, newcomer.job_id}
        _run(busy, busy_proxy)
        with pytest.raises(JobEnded) as raised:
            idle.proxy(two_output_pipeline())
        message = str(raised.value)
        assert re.search(
            rf"job {idle.job_id} was ended after \d+ s idle, to make room for another job's "
            rf"pipeline \(job {newcomer.job_id}\); the daemon is full: the daemon runs 2 "
            "pipelines",
            message,
        ), message
        assert "--reclaim-idle-s" in message
    finally:
        log = _stopped_clean(daemon)
    assert log.count("reclaimed after") == 1, log


def test_a_new_pipeline_that_finds_every_dali_thread_held_ends_an_idle_job(
    short_tmp: Path, sessions: list[dalid.Session]
) -> None:
    daemon = start_daemon(
        short_tmp,
        "--max-threads",
        "1",
        "--max-jobs-per-user",
        "0",
        "--share-pipelines",
        "no",
        "--reclaim-idle-s",
        f"{IDLE_S:g}",
    )
    try:
        idle = _connect(daemon, sessions, name="idle")
        _run(idle, idle.proxy(two_output_pipeline()))
        newcomer = _connect(daemon, sessions, name="newcomer")
        time.sleep(IDLE_S + 0.3)
        newcomer_proxy = newcomer.proxy(two_output_pipeline())
        _run(newcomer, newcomer_proxy)
        assert [job.job_id for job in daemon.status().jobs] == [newcomer.job_id]
        with pytest.raises(JobEnded, match=r"the daemon is full: the daemon's pipelines have all"):
            idle.proxy(two_output_pipeline())
    finally:
        log = _stopped_clean(daemon)
    assert log.count("reclaimed after") == 1, log


def test_with_reclaiming_off_a_pipeline_that_finds_no_room_is_refused_as_before(
    short_tmp: Path, sessions: list[dalid.Session]
) -> None:
    daemon = start_daemon(
        short_tmp,
        "--max-daemon-pipelines",
        "1",
        "--max-jobs-per-user",
        "0",
        "--share-pipelines",
        "no",
        "--reclaim-idle-s",
        "0",
    )
    try:
        idle = _connect(daemon, sessions, name="idle")
        idle.proxy(two_output_pipeline())
        newcomer = _connect(daemon, sessions, name="newcomer")
        time.sleep(0.5)
        with pytest.raises(RequestError) as raised:
            newcomer.proxy(two_output_pipeline())
        assert str(raised.value).endswith(
            "the daemon runs 1 pipelines, its limit (dalid serve --max-daemon-pipelines 1): "
            "wait for jobs to end, or register a pipeline another job runs already"
        )
        assert len(daemon.status().jobs) == 2
    finally:
        log = _stopped_clean(daemon)
    assert "reclaimed" not in log
