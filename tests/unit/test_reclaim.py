"""Idle jobs reclaimed for a newcomer, a new job or another job's new pipeline
(``dalid.server.jobs.reclaim``): the choice of the job to end, alone, and the daemon core that
ends it and tells its trainer why."""

from __future__ import annotations

import queue
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from nvidia.dali import fn
from nvidia.dali.data_node import DataNode

from dalid.client.errors import JobEnded, ended_notice, error_from_reply
from dalid.protocol import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Hello,
    InputBatch,
    Message,
    PipelineRegistered,
    RegisterPipeline,
    ReleaseRegions,
    Role,
    SubmitBatch,
    Welcome,
)
from dalid.server.handling.core import DaemonCore
from dalid.server.intake.credentials import PeerCredentials
from dalid.server.jobs.quotas import Full, Quotas
from dalid.server.jobs.reclaim import job_to_end
from dalid.server.outputs.shm import host_outputs

from ..dali_typing import pipeline_def

# --- the choice ---------------------------------------------------------------------------------


@dataclass
class Held:
    """What the choice reads of a job: its uid, when it was last active, whether it is busy."""

    name: str
    uid: int
    active_at: float
    busy: bool = False


NOW = 1000.0


def _chosen(
    jobs: list[Held],
    full: Full,
    *,
    uid: int = 1,
    idle_s: float = 10.0,
    holds: dict[str, int] | None = None,
    asking: Held | None = None,
) -> str | None:
    """The name of the job chosen; ``holds``: what each job holds of the full limit, by name
    (None: a place each, as for a hello)."""
    held = None if holds is None else (lambda job: holds.get(job.name, 0))
    job = job_to_end(jobs, full, uid=uid, now=NOW, idle_s=idle_s, holds=held, asking=asking)
    return None if job is None else job.name


def test_the_users_share_ends_that_users_job_idle_longest() -> None:
    jobs = [
        Held("other user's, idle longest", 2, NOW - 500),
        Held("idle a while", 1, NOW - 20),
        Held("idle longest", 1, NOW - 60),
        Held("just active", 1, NOW - 1),
    ]
    assert _chosen(jobs, Full.USER, uid=1) == "idle longest"
    assert _chosen(jobs, Full.USER, uid=2) == "other user's, idle longest"


def test_the_daemons_limit_ends_a_job_of_the_user_holding_the_most() -> None:
    jobs = [
        Held("few's, idle longest", 1, NOW - 500),
        Held("many's", 2, NOW - 20),
        Held("many's, idle longer", 2, NOW - 60),
        Held("many's, active", 2, NOW - 1),
    ]
    # Whoever the newcomer is: the uid holding the most gives the place.
    assert _chosen(jobs, Full.DAEMON, uid=1) == "many's, idle longer"
    assert _chosen(jobs, Full.DAEMON, uid=3) == "many's, idle longer"
    # Uids that hold as many compete together.
    jobs.append(Held("few's, now as many", 1, NOW - 30))
    jobs.append(Held("few's, third", 1, NOW - 2))
    assert _chosen(jobs, Full.DAEMON) == "few's, idle longest"


def test_a_busy_job_or_one_idle_too_short_is_never_ended() -> None:
    jobs = [Held("busy", 1, NOW - 500, busy=True), Held("idle a moment", 1, NOW - 9.9)]
    assert _chosen(jobs, Full.USER) is None
    assert _chosen(jobs, Full.DAEMON) is None
    jobs.append(Held("idle just long enough", 1, NOW - 10))
    assert _chosen(jobs, Full.USER) == "idle just long enough"


def test_reclaiming_off_ends_nothing() -> None:
    jobs = [Held("idle for ages", 1, 0.0)]
    assert _chosen(jobs, Full.USER, idle_s=0) is None
    assert _chosen(jobs, Full.DAEMON, idle_s=0) is None
    assert _chosen([], Full.DAEMON) is None


def test_for_a_pipeline_only_a_job_whose_end_frees_some_of_the_full_limit_is_ended() -> None:
    jobs = [
        Held("no pipeline, idle longest", 1, NOW - 500),
        Held("shares its only pipeline", 1, NOW - 400),
        Held("two pipelines of its own", 1, NOW - 60),
    ]
    holds = {"two pipelines of its own": 2}
    assert _chosen(jobs, Full.USER, holds=holds) == "two pipelines of its own"
    assert _chosen(jobs, Full.DAEMON, holds=holds) == "two pipelines of its own"
    assert _chosen(jobs, Full.USER, holds={}) is None


def test_for_the_daemons_pipelines_the_user_holding_the_most_of_them_gives_one() -> None:
    jobs = [
        Held("many jobs, one pipeline", 1, NOW - 500),
        Held("many jobs, none", 1, NOW - 500),
        Held("many jobs, none either", 1, NOW - 500),
        Held("one job, three pipelines", 2, NOW - 60),
    ]
    holds = {"many jobs, one pipeline": 1, "one job, three pipelines": 3}
    # Uid 1 holds the most jobs, uid 2 the most pipelines: uid 2's job is ended for a pipeline.
    assert _chosen(jobs, Full.DAEMON) == "many jobs, one pipeline"
    assert _chosen(jobs, Full.DAEMON, uid=1, holds=holds) == "one job, three pipelines"


def test_the_job_that_asks_is_never_ended_for_itself_though_its_holdings_count() -> None:
    asking = Held("asking, idle longest", 2, NOW - 500)
    other = Held("the other user's", 1, NOW - 60)
    jobs = [asking, Held("asking user's other", 2, NOW - 30), other]
    holds = {"asking, idle longest": 3, "asking user's other": 1, "the other user's": 2}
    # Uid 2 holds 4 with the asking job's 3: its other job gives the place, never the asker.
    assert _chosen(jobs, Full.DAEMON, uid=2, holds=holds, asking=asking) == "asking user's other"
    assert _chosen(jobs, Full.USER, uid=2, holds=holds, asking=asking) == "asking user's other"
    assert _chosen([asking, other], Full.USER, uid=2, holds=holds, asking=asking) is None


# --- the daemon core ----------------------------------------------------------------------------

IDLE_S = 0.3


@pipeline_def(batch_size=4, num_threads=1, device_id=None)
def doubling() -> DataNode:
    return fn.external_source(name="x") * 2


class Core(DaemonCore):
    """A CPU core of ``max_jobs`` jobs whose pushes land in ``pushed``, and whose connections
    are the processes ``credentials`` names."""

    def __init__(self, **limits: float) -> None:
        self.pushed: queue.Queue[tuple[bytes, Message, int | None]] = queue.Queue()
        self.credentials: dict[bytes, PeerCredentials] = {}
        quotas = Quotas(max_batch_size=64, pool_bytes=1 << 20, slab_bytes=1 << 16, **limits)  # type: ignore[arg-type]
        super().__init__(
            "cpu",
            host_outputs(),
            lambda peer, message, rid: self.pushed.put((peer, message, rid)),
            quotas,
            instance=f"unittest-{uuid.uuid4().hex[:8]}",
            credentials=self.credentials.get,
        )

    def hello(self, identity: bytes, pid: int, uid: int = 1000) -> Message | None:
        self.credentials[identity] = PeerCredentials(pid, uid, uid)
        return self.handle(identity, Hello(PROTOCOL_VERSION, pid, Role.TRAINER), 1)

    def notices(self) -> dict[bytes, Error]:
        """The errors pushed with no request id so far, by the connection they went to."""
        found = {}
        while not self.pushed.empty():
            peer, message, rid = self.pushed.get_nowait()
            if rid is None and isinstance(message, Error):
                found[peer] = message
        return found


@pytest.fixture
def core() -> Iterator[Core]:
    daemon = Core(max_jobs=2, max_jobs_per_user=0, reclaim_idle_s=IDLE_S)
    yield daemon
    daemon.close()


def test_a_full_daemon_ends_the_job_idle_longest_and_tells_its_trainer_why(core: Core) -> None:
    assert isinstance(core.hello(b"a", 100), Welcome)
    b_welcome = core.hello(b"b", 101)
    assert isinstance(b_welcome, Welcome)
    # Not idle long enough yet: refused as before, saying that none was.
    refused = core.hello(b"c", 102)
    assert isinstance(refused, Error) and refused.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "already serves 2 jobs" in refused.message
    assert f"none of the jobs it competes with has been idle for {IDLE_S:g} s" in refused.message
    time.sleep(IDLE_S + 0.1)
    # a connected first, but a release since counts as activity: b is the one idle longest.
    assert core.handle(b"a", ReleaseRegions(()), None) is None
    assert isinstance(core.hello(b"c", 102), Welcome)
    assert sorted(job.pid for job in core.jobs.values()) == [100, 102]
    notice = core.notices()[b"b"]
    assert notice.code is ErrorCode.UNKNOWN_JOB and notice.ends_jobs
    assert "was ended after 0 s idle, to make room for a new job" in notice.message
    assert "the daemon is full: this daemon already serves 2 jobs" in notice.message
    assert "--reclaim-idle-s" in notice.message
    # What its client raises: the reason, as data.
    ended = ended_notice(notice)
    assert isinstance(ended, JobEnded) and "ended this job" in str(ended)
    # Its connection is in no job any more.
    after = core.handle(b"b", RegisterPipeline(memoryview(b""), ("x",), 1, 4, 1, 2), 5)
    assert isinstance(after, Error) and after.code is ErrorCode.NOT_WELCOMED
    # A worker that joins it later (its trainer's first batch, say) is told the same, and its
    # client raises it as the same JobEnded.
    core.credentials[b"b-worker"] = PeerCredentials(101, 1000, 1000)
    worker_hello = Hello(
        PROTOCOL_VERSION, 101, Role.WORKER, job_id=b_welcome.job_id, job_token=b_welcome.job_token
    )
    refused = core.handle(b"b-worker", worker_hello, 1)
    assert isinstance(refused, Error) and refused.code is ErrorCode.UNKNOWN_JOB
    assert refused.ends_jobs and refused.message == notice.message
    raised = error_from_reply(refused)
    assert isinstance(raised, JobEnded) and str(raised) == str(ended)


def test_a_job_with_batches_is_never_ended(core: Core) -> None:
    assert isinstance(core.hello(b"a", 100), Welcome)
    request = RegisterPipeline(memoryview(doubling().serialize()), ("x",), 1, 4, 1, 2)
    assert core.handle(b"a", request, 2) is None
    peer, registered, _ = core.pushed.get(timeout=30)
    assert peer == b"a" and isinstance(registered, PipelineRegistered)
    # A deferred batch waits for the trainer's schedule: the job is busy however long.
    batch = SubmitBatch(
        registered.pipeline_id,
        (InputBatch.of("x", [np.zeros((1,), np.int32)]),),
        core.peers[b"a"].batch_ids.base + 1,
        deferred=True,
    )
    core.handle(b"a", batch, 3)
    assert isinstance(core.hello(b"b", 101), Welcome)
    time.sleep(IDLE_S + 0.1)
    assert isinstance(core.handle(b"b", ReleaseRegions(()), None), type(None))
    refused = core.hello(b"c", 102)
    assert isinstance(refused, Error) and "none of the jobs" in refused.message
    assert len(core.jobs) == 2 and not core.notices()


def test_the_users_share_ends_a_job_of_that_user_and_a_process_may_not_pass_its_limit() -> None:
    core = Core(max_jobs=8, max_jobs_per_user=2, max_jobs_per_process=2, reclaim_idle_s=IDLE_S)
    try:
        assert isinstance(core.hello(b"root's", 300, uid=0), Welcome)
        assert isinstance(core.hello(b"a", 100), Welcome)
        assert isinstance(core.hello(b"b", 100), Welcome)
        time.sleep(IDLE_S + 0.1)
        # Process 100 is at its own limit: no job of anyone's is ended for it.
        refused = core.hello(b"c", 100)
        assert isinstance(refused, Error) and "the limit of one process" in refused.message
        assert "idle" not in refused.message
        # Another process of the same user: its user's share is full, and a job of that user,
        # not root's (idle longer), makes room.
        assert isinstance(core.hello(b"d", 101), Welcome)
        assert set(core.notices()) == {b"a"}
        assert sorted(job.pid for job in core.jobs.values()) == [100, 101, 300]
    finally:
        core.close()


def test_with_reclaiming_off_the_refusal_stays_as_it_was() -> None:
    core = Core(max_jobs=1, reclaim_idle_s=0)
    try:
        assert isinstance(core.hello(b"a", 100), Welcome)
        time.sleep(0.05)
        refused = core.hello(b"b", 101)
        assert isinstance(refused, Error) and refused.message == (
            "this daemon already serves 1 jobs, its limit (dalid serve --max-jobs 1): wait for "
            "one to end, or start the daemon with a higher limit"
        )
        assert len(core.jobs) == 1 and not core.notices()
    finally:
        core.close()


def _register(core: Core, identity: bytes, request_id: int) -> Message | None:
    """A deterministic pipeline of the job of ``identity``: one of its own, never shared."""
    request = RegisterPipeline(
        memoryview(doubling().serialize()), ("x",), 1, 4, 1, 2, deterministic=True
    )
    return core.handle(identity, request, request_id)


def _answer(core: Core, identity: bytes) -> tuple[Message, dict[bytes, Error]]:
    """The next reply to ``identity`` that has a request id, and the notices pushed before."""
    notices = {}
    while True:
        peer, message, rid = core.pushed.get(timeout=60)
        if rid is None and isinstance(message, Error):
            notices[peer] = message
        elif peer == identity and rid is not None:
            return message, notices


def test_a_pipeline_refused_for_the_daemons_pipelines_ends_a_job_idle_long_enough() -> None:
    core = Core(max_jobs=4, max_jobs_per_user=0, max_daemon_pipelines=1, reclaim_idle_s=IDLE_S)
    try:
        for identity, pid in ((b"a", 100), (b"idle, none", 101), (b"b", 102)):
            assert isinstance(core.hello(identity, pid), Welcome)
        assert _register(core, b"a", 2) is None
        assert isinstance(_answer(core, b"a")[0], PipelineRegistered)
        # Not idle long enough yet: refused as before, saying that none was.
        refused = _register(core, b"b", 3)
        assert isinstance(refused, Error) and refused.code is ErrorCode.RESOURCE_EXHAUSTED
        assert refused.message.startswith(
            "the daemon runs 1 pipelines, its limit (dalid serve --max-daemon-pipelines 1)"
        )
        assert f"none of the jobs it competes with has been idle for {IDLE_S:g} s" in (
            refused.message
        )
        time.sleep(IDLE_S + 0.1)
        # The job idle longest holds no pipeline: the one that holds it is ended instead.
        assert _register(core, b"b", 4) is None
        registered, notices = _answer(core, b"b")
        assert isinstance(registered, PipelineRegistered), registered
        assert set(notices) == {b"a"}
        notice = notices[b"a"]
        assert notice.code is ErrorCode.UNKNOWN_JOB and notice.ends_jobs
        assert re.search(
            r"job \d+ was ended after 0 s idle, to make room for another job's pipeline "
            r"\(job \d+\); the daemon is full: the daemon runs 1 pipelines",
            notice.message,
        ), notice.message
        assert sorted(job.pid for job in core.jobs.values()) == [101, 102]
        assert len(core.pipelines.instances) == 1
    finally:
        core.close()


def test_a_job_may_not_end_another_to_pass_its_own_limit_of_pipelines() -> None:
    core = Core(max_jobs=4, max_pipelines=1, max_daemon_pipelines=2, reclaim_idle_s=IDLE_S)
    try:
        assert isinstance(core.hello(b"a", 100), Welcome)
        assert isinstance(core.hello(b"b", 101), Welcome)
        assert _register(core, b"a", 2) is None
        assert isinstance(_answer(core, b"a")[0], PipelineRegistered)
        assert _register(core, b"b", 2) is None
        assert isinstance(_answer(core, b"b")[0], PipelineRegistered)
        time.sleep(IDLE_S + 0.1)
        refused = _register(core, b"b", 3)
        assert isinstance(refused, Error) and "the limit of one job" in refused.message
        assert "idle" not in refused.message
        assert len(core.jobs) == 2 and not core.notices()
    finally:
        core.close()


def test_with_reclaiming_off_a_pipeline_is_refused_as_it_was() -> None:
    core = Core(max_jobs=4, max_daemon_pipelines=1, reclaim_idle_s=0)
    try:
        assert isinstance(core.hello(b"a", 100), Welcome)
        assert isinstance(core.hello(b"b", 101), Welcome)
        assert _register(core, b"a", 2) is None
        assert isinstance(_answer(core, b"a")[0], PipelineRegistered)
        time.sleep(0.05)
        refused = _register(core, b"b", 3)
        assert isinstance(refused, Error) and refused.message == (
            "the daemon runs 1 pipelines, its limit (dalid serve --max-daemon-pipelines 1): "
            "wait for jobs to end, or register a pipeline another job runs already"
        )
        assert len(core.jobs) == 2 and not core.notices()
    finally:
        core.close()
