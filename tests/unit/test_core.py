"""DaemonCore without sockets: requests in, replies and pushes out (the real path is in
tests/integration)."""

from __future__ import annotations

import dataclasses
import itertools
import queue
import uuid
from collections.abc import Iterable, Iterator

import numpy as np
import pytest
from nvidia.dali import fn
from nvidia.dali.data_node import DataNode

from dalid.protocol import (
    PROTOCOL_VERSION,
    BatchAccepted,
    BatchFailed,
    BatchReady,
    EarlierJob,
    EarlierPipeline,
    Error,
    ErrorCode,
    Hello,
    InputBatch,
    Message,
    Ok,
    PipelineRegistered,
    RegisterPipeline,
    ReleaseRegions,
    Role,
    ScheduleBatch,
    Shutdown,
    SubmitBatch,
    TrainerProgress,
    Welcome,
    WorkerLeft,
)
from dalid.server.handling.core import DaemonCore, StopAsked
from dalid.server.intake.credentials import PeerCredentials
from dalid.server.jobs.jobs import job_label
from dalid.server.jobs.quotas import Quotas
from dalid.server.outputs.shm import host_outputs
from dalid.server.pipelines.flight import (
    PROBATION_RUNS,
    FlightRecorder,
    Standing,
    Suspect,
    graph_key,
)
from dalid.server.pipelines.sharing import read_graph

from ..dali_typing import pipeline_def

TRAINER = b"trainer"
WORKER = b"worker"


@pipeline_def(batch_size=4, num_threads=1, device_id=None)
def doubling() -> DataNode:
    return fn.external_source(name="x") * 2


class PushingCore(DaemonCore):
    """A CPU core whose messages to peers (``push``) land in ``pushed``."""

    def __init__(self, quotas: Quotas) -> None:
        self.pushed: queue.Queue[tuple[bytes, Message, int | None]] = queue.Queue()
        super().__init__(
            "cpu",
            host_outputs(),
            lambda peer, message, rid: self.pushed.put((peer, message, rid)),
            quotas,
            instance=f"unittest-{uuid.uuid4().hex[:8]}",
        )


@pytest.fixture
def core() -> Iterator[PushingCore]:
    daemon = PushingCore(Quotas(max_batch_size=64, pool_bytes=1 << 20, slab_bytes=1 << 16))
    yield daemon
    daemon.close()


def _hello(core: PushingCore) -> Welcome:
    import os

    reply = core.handle(TRAINER, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER), 1)
    assert isinstance(reply, Welcome)
    return reply


def _register(core: PushingCore) -> int:
    pipe = doubling()
    request = RegisterPipeline(memoryview(pipe.serialize()), ("x",), 1, 4, 1, 2)
    assert core.handle(TRAINER, request, 2) is None  # built in the executor's thread
    peer, reply, rid = core.pushed.get(timeout=30)
    assert (peer, rid) == (TRAINER, 2)
    assert isinstance(reply, PipelineRegistered)
    return reply.pipeline_id


_counter = itertools.count(1)


def _next_id(core: DaemonCore, identity: bytes) -> int:
    """An id of the connection's range above any it used (ids rise across the tests)."""
    return core.peers[identity].batch_ids.base + next(_counter)


def _batch(
    core: DaemonCore,
    identity: bytes,
    pipeline_id: int,
    *samples: np.ndarray,
    deferred: bool = False,
) -> SubmitBatch:
    return SubmitBatch(
        pipeline_id,
        (InputBatch.of("x", list(samples)),),
        _next_id(core, identity),
        deferred=deferred,
    )


def test_requests_before_hello_are_refused(core: PushingCore) -> None:
    reply = core.handle(TRAINER, ReleaseRegions((1,)), 1)
    assert isinstance(reply, Error) and reply.code is ErrorCode.NOT_WELCOMED


def test_notifications_from_a_connection_in_no_job_are_ignored(core: PushingCore) -> None:
    # A release or progress report from a job that ended, or that another daemon welcomed:
    # no error goes back to a peer that awaits none (it would only log it).
    assert core.handle(TRAINER, ReleaseRegions((1,)), None) is None
    assert core.handle(TRAINER, TrainerProgress(1.0, 3), None) is None


def test_a_job_is_named_once_in_the_log() -> None:
    assert job_label("resnet", 12) == "resnet, pid 12"
    assert job_label("pid 12", 12) == "pid 12"
    assert job_label("", 12) == "pid 12"


@pytest.mark.parametrize(
    ("end_jobs", "asked"), [(False, StopAsked.KEEP_JOBS), (True, StopAsked.END_JOBS)]
)
def test_a_shutdown_request_says_whether_the_jobs_end_with_the_daemon(
    core: PushingCore, end_jobs: bool, asked: StopAsked
) -> None:
    assert core.stop_asked is StopAsked.NO
    assert isinstance(core.handle(b"stop", Shutdown(end_jobs=end_jobs), 1), Ok)
    assert core.stop_asked is asked


def test_a_batch_runs_and_its_regions_are_leased_until_released(core: PushingCore) -> None:
    _hello(core)
    pipeline_id = _register(core)
    samples = [np.full((2, 3), i, np.int32) for i in range(3)]
    accepted = core.handle(TRAINER, _batch(core, TRAINER, pipeline_id, *samples), 3)
    assert isinstance(accepted, BatchAccepted)
    peer, ready, rid = core.pushed.get(timeout=30)
    assert peer == TRAINER and rid is None and isinstance(ready, BatchReady)
    (output,) = ready.outputs
    assert output.shape == (3, 2, 3) and output.dtype == "int32"
    job = core.jobs[1]
    assert job.outputs.leased_regions == 1
    assert core.handle(TRAINER, ReleaseRegions((output.region_id,)), None) is None
    assert job.outputs.leased_regions == 0
    # A second release of the same region is an error, and changes nothing.
    again = core.handle(TRAINER, ReleaseRegions((output.region_id,)), None)
    assert isinstance(again, Error) and again.code is ErrorCode.UNKNOWN_REGION


def test_a_release_carries_the_trainers_progress_as_its_own_report_would(
    core: PushingCore,
) -> None:
    """``welcome.progress_in_release``: the figures a release carries are the job's, as a
    ``trainer_progress`` sent after it would make them, even when the release is refused."""
    welcome = _hello(core)
    assert welcome.progress_in_release
    job = core.jobs[1]
    assert core.handle(TRAINER, ReleaseRegions((), progress=TrainerProgress(2.5, 4)), None) is None
    assert job.trainer_waited == 2.5
    refused = core.handle(TRAINER, ReleaseRegions((12345,), progress=TrainerProgress(3.0, 5)), None)
    assert isinstance(refused, Error) and refused.code is ErrorCode.UNKNOWN_REGION
    assert job.trainer_waited == 3.0
    assert core.handle(TRAINER, TrainerProgress(4.0, 6), None) is None
    assert job.trainer_waited == 4.0


def test_bad_batches_are_refused_before_they_are_queued(core: PushingCore) -> None:
    _hello(core)
    pipeline_id = _register(core)
    sample = np.zeros((2, 3), np.int32)
    # Refused once sent, each fails as its batch (the trainer sent these: no push).
    unknown = core.handle(TRAINER, _batch(core, TRAINER, pipeline_id + 1, sample), 3)
    assert isinstance(unknown, BatchFailed) and unknown.code is ErrorCode.UNKNOWN_PIPELINE
    too_big = core.handle(TRAINER, _batch(core, TRAINER, pipeline_id, *[sample] * 5), 4)
    assert isinstance(too_big, BatchFailed) and "max_batch_size" in too_big.message
    needs = r"shape \(2, 4\) of int32 needs 32 bytes, the frame has 24"
    with pytest.raises(ValueError, match=needs):  # refused before it is sent
        InputBatch("x", "int32", 1, 2, np.array([2, 4], "<u8").data, sample.data)
    wrong_name = SubmitBatch(
        pipeline_id,
        (InputBatch.of("y", [sample]),),
        _next_id(core, TRAINER),
    )
    reply = core.handle(TRAINER, wrong_name, 6)
    assert isinstance(reply, BatchFailed) and "takes ['x']" in reply.message
    assert reply.batch_id == wrong_name.batch_id
    assert core.pushed.empty()


def test_a_worker_needs_the_job_token(core: PushingCore) -> None:
    import os

    welcome = _hello(core)
    wrong = Hello(PROTOCOL_VERSION, os.getpid(), Role.WORKER, job_id=welcome.job_id, job_token="x")
    reply = core.handle(WORKER, wrong, 1)
    assert isinstance(reply, Error) and reply.code is ErrorCode.UNKNOWN_JOB
    right = Hello(
        PROTOCOL_VERSION,
        os.getpid(),
        Role.WORKER,
        job_id=welcome.job_id,
        job_token=welcome.job_token,
    )
    assert isinstance(core.handle(WORKER, right, 2), Welcome)


def test_goodbye_frees_the_job(core: PushingCore) -> None:
    from dalid.protocol import Goodbye

    _hello(core)
    pipeline_id = _register(core)
    core.handle(TRAINER, _batch(core, TRAINER, pipeline_id, np.zeros((1,), np.int32)), 3)
    core.pushed.get(timeout=30)
    outputs = core.jobs[1].outputs
    assert outputs.slab_count == 1
    assert core.registry.ended == 0
    core.handle(TRAINER, Goodbye(), 4)
    assert not core.jobs and not core.peers
    assert outputs.slab_count == 0
    assert core.registry.ended == 1  # the daemon gives freed memory back after each


def test_workers_that_come_and_go_leave_no_record_behind(core: PushingCore) -> None:
    """As a DataLoader without persistent workers makes them: new connections every epoch.
    Each worker that leaves, by goodbye or by its connection's close, is forgotten; what the
    job's pipeline remembers of them is bounded."""
    from dalid.protocol import Goodbye
    from dalid.server.runs.runs import SENDERS_REMEMBERED

    welcome = _hello(core)
    _register(core)
    job = core.jobs[welcome.job_id]
    for index in range(SENDERS_REMEMBERED + 100):
        identity = b"worker-%d" % index
        hello = _worker_hello(core, identity, welcome.job_id, welcome.job_token)
        assert isinstance(hello, Welcome)
        if index % 2:
            assert isinstance(core.handle(identity, Goodbye(), 2), Ok)
        else:
            core.peer_disconnected(identity)
    assert set(core.peers) == {TRAINER}
    assert job.peers == {TRAINER}
    (member,) = job.pipelines.values()
    assert len(member.senders_left) == SENDERS_REMEMBERED


# --- earlier jobs: workers rejoining a trainer's job after a daemon restart -----------------------

OLD_TOKEN = "token-of-a-job-of-an-earlier-daemon"


def _trainer_hello(core: DaemonCore, identity: bytes, *earlier: EarlierJob) -> Message | None:
    import os

    hello = Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER, earlier_jobs=earlier)
    return core.handle(identity, hello, 1)


def _worker_hello(core: DaemonCore, identity: bytes, job_id: int, token: str) -> Message | None:
    import os

    hello = Hello(PROTOCOL_VERSION, os.getpid(), Role.WORKER, job_id=job_id, job_token=token)
    return core.handle(identity, hello, 1)


def _register_again(core: PushingCore, *earlier: EarlierPipeline) -> int:
    request = RegisterPipeline(
        memoryview(doubling().serialize()), ("x",), 1, 4, 1, 2, earlier_ids=earlier
    )
    assert core.handle(TRAINER, request, 2) is None
    _, reply, _ = core.pushed.get(timeout=30)
    assert isinstance(reply, PipelineRegistered)
    return reply.pipeline_id


def test_a_worker_of_an_earlier_job_joins_the_new_job_and_submits_under_the_earlier_id(
    core: PushingCore,
) -> None:
    welcome = _trainer_hello(core, TRAINER, EarlierJob(7, OLD_TOKEN))
    assert isinstance(welcome, Welcome) and welcome.job_token != OLD_TOKEN
    pipeline_id = _register_again(core, EarlierPipeline(OLD_TOKEN, 42))
    joined = _worker_hello(core, WORKER, 7, OLD_TOKEN)
    assert isinstance(joined, Welcome)
    # The welcome names the new job: the worker stamps its token on the batches it submits.
    assert (joined.job_id, joined.job_token) == (welcome.job_id, welcome.job_token)
    assert core.status().jobs[0].workers == 1
    sample = np.arange(6, dtype=np.int32).reshape(2, 3)
    accepted = core.handle(WORKER, _batch(core, WORKER, 42, sample), 3)
    assert isinstance(accepted, BatchAccepted)
    peer, ready, _ = core.pushed.get(timeout=30)
    assert peer == TRAINER and isinstance(ready, BatchReady)
    assert (ready.batch_id, ready.pipeline_id) == (accepted.batch_id, pipeline_id)
    # An id the pipeline never had in the earlier job names nothing for this worker.
    unknown = core.handle(WORKER, _batch(core, WORKER, pipeline_id, sample), 4)
    assert isinstance(unknown, BatchFailed) and unknown.code is ErrorCode.UNKNOWN_PIPELINE


def test_an_earlier_job_still_needs_its_token(core: PushingCore) -> None:
    _trainer_hello(core, TRAINER, EarlierJob(7, OLD_TOKEN))
    for job_id, token in [(7, "not-the-token"), (7, OLD_TOKEN[:-1]), (8, OLD_TOKEN), (7, "é")]:
        reply = _worker_hello(core, WORKER, job_id, token)
        assert isinstance(reply, Error) and reply.code is ErrorCode.UNKNOWN_JOB, (job_id, token)
    assert WORKER not in core.peers


def test_a_worker_before_the_pipeline_is_registered_again_is_told_so(core: PushingCore) -> None:
    _trainer_hello(core, TRAINER, EarlierJob(7, OLD_TOKEN))
    assert isinstance(_worker_hello(core, WORKER, 7, OLD_TOKEN), Welcome)
    reply = core.handle(WORKER, _batch(core, WORKER, 42, np.zeros((1,), np.int32)), 2)
    assert isinstance(reply, BatchFailed) and reply.code is ErrorCode.UNKNOWN_PIPELINE
    assert "not registered again pipeline 42" in reply.message
    # The worker handed the batch on: its trainer is told, and submits it again.
    assert core.pushed.get_nowait() == (TRAINER, reply, None)


def test_a_claim_on_an_identity_that_names_a_job_here_is_refused(core: PushingCore) -> None:
    live = _trainer_hello(core, TRAINER, EarlierJob(7, OLD_TOKEN))
    assert isinstance(live, Welcome)
    for earlier, named in [
        (EarlierJob(live.job_id, live.job_token), "a live job"),
        (EarlierJob(7, OLD_TOKEN), f"claimed by job {live.job_id}"),
    ]:
        reply = _trainer_hello(core, b"another trainer", EarlierJob(3, "other"), earlier)
        assert isinstance(reply, Error) and reply.code is ErrorCode.JOB_CLAIMED
        assert named in reply.message
        # A refused hello opens nothing, and claims nothing.
        assert list(core.jobs) == [live.job_id] and b"another trainer" not in core.peers
        assert isinstance(_worker_hello(core, WORKER, 3, "other"), Error)
    # The same job id with another token is another job (ids repeat from daemon to daemon).
    other = _trainer_hello(core, b"another trainer", EarlierJob(7, "other"))
    assert isinstance(other, Welcome)
    joined = _worker_hello(core, WORKER, 7, "other")
    assert isinstance(joined, Welcome) and joined.job_id == other.job_id != live.job_id


def test_a_registration_names_only_earlier_jobs_its_hello_claimed(core: PushingCore) -> None:
    _trainer_hello(core, TRAINER, EarlierJob(7, OLD_TOKEN))
    request = RegisterPipeline(
        memoryview(doubling().serialize()),
        ("x",),
        1,
        4,
        1,
        2,
        earlier_ids=(EarlierPipeline("a-token-never-claimed", 1),),
    )
    reply = core.handle(TRAINER, request, 2)
    assert isinstance(reply, Error) and reply.code is ErrorCode.UNKNOWN_JOB
    assert not core.jobs[1].pipelines


def test_earlier_jobs_go_when_the_job_ends(core: PushingCore) -> None:
    from dalid.protocol import Goodbye

    _trainer_hello(core, TRAINER, EarlierJob(7, OLD_TOKEN))
    _register_again(core, EarlierPipeline(OLD_TOKEN, 42))
    assert isinstance(_worker_hello(core, WORKER, 7, OLD_TOKEN), Welcome)
    assert isinstance(core.handle(TRAINER, Goodbye(), 3), Ok)
    assert not core.jobs and not core.peers
    reply = _worker_hello(core, b"late worker", 7, OLD_TOKEN)
    assert isinstance(reply, Error) and reply.code is ErrorCode.UNKNOWN_JOB
    # Free to be claimed again, by the trainer that reconnects next.
    assert isinstance(_trainer_hello(core, b"next trainer", EarlierJob(7, OLD_TOKEN)), Welcome)


def test_a_worker_of_an_earlier_job_reaches_no_other_jobs_regions(core: PushingCore) -> None:
    first = _hello(core)
    pipeline_id = _register(core)
    core.handle(TRAINER, _batch(core, TRAINER, pipeline_id, np.zeros((1,), np.int32)), 3)
    _, ready, _ = core.pushed.get(timeout=30)
    assert isinstance(ready, BatchReady)
    (output,) = ready.outputs
    _trainer_hello(core, b"second trainer", EarlierJob(first.job_id, OLD_TOKEN))
    assert isinstance(_worker_hello(core, WORKER, first.job_id, OLD_TOKEN), Welcome)
    # The worker joined the second job: the first job's region is not its to release.
    reply = core.handle(WORKER, ReleaseRegions((output.region_id,)), None)
    assert isinstance(reply, Error) and reply.code is ErrorCode.UNKNOWN_REGION
    assert core.jobs[first.job_id].outputs.leased_regions == 1


# --- who the daemon serves, and how much ----------------------------------------------------------


def _limited_core(credentials: dict[bytes, PeerCredentials], **limits: int) -> DaemonCore:
    quotas = Quotas(max_batch_size=64, pool_bytes=1 << 20, slab_bytes=1 << 16, **limits)
    return DaemonCore(
        "cpu",
        host_outputs(),
        lambda *_: None,
        quotas,
        instance=f"unittest-{uuid.uuid4().hex[:8]}",
        credentials=credentials.get,
    )


def test_a_job_is_the_process_its_socket_names_not_the_pid_it_claims() -> None:
    credentials = {TRAINER: PeerCredentials(pid=4242, uid=0, gid=0)}
    core = _limited_core(credentials)
    try:
        reply = core.handle(TRAINER, Hello(PROTOCOL_VERSION, 0, Role.TRAINER), 1)
        assert isinstance(reply, Welcome)
        assert core.jobs[reply.job_id].pid == 4242
        # Without credentials (no socket) the job lives as long as its connection.
        other = core.handle(WORKER, Hello(PROTOCOL_VERSION, 1, Role.TRAINER), 1)
        assert isinstance(other, Welcome) and core.jobs[other.job_id].pid == 0
    finally:
        core.close()


def test_one_process_holds_at_most_its_share_of_the_jobs() -> None:
    credentials: dict[bytes, PeerCredentials] = {}
    core = _limited_core(credentials, max_jobs_per_process=2)
    try:

        def hello(identity: bytes, pid: int) -> Message | None:
            credentials[identity] = PeerCredentials(pid, 0, 0)
            return core.handle(identity, Hello(PROTOCOL_VERSION, 1, Role.TRAINER), 1)

        assert isinstance(hello(b"a", 100), Welcome)
        assert isinstance(hello(b"b", 100), Welcome)
        refused = hello(b"c", 100)
        assert isinstance(refused, Error) and refused.code is ErrorCode.RESOURCE_EXHAUSTED
        assert "process 100 already has 2 jobs" in refused.message
        assert "--max-jobs-per-process 2" in refused.message
        assert isinstance(hello(b"d", 101), Welcome)  # another process
        # Processes the daemon cannot see (pid 0) are not counted together.
        assert all(isinstance(hello(bytes([i]), 0), Welcome) for i in range(3))
    finally:
        core.close()


def test_one_user_holds_at_most_its_share_of_the_jobs() -> None:
    credentials: dict[bytes, PeerCredentials] = {}
    core = _limited_core(credentials, max_jobs=4, max_jobs_per_user=2)
    try:

        def hello(identity: bytes, pid: int, uid: int) -> Message | None:
            credentials[identity] = PeerCredentials(pid, uid, uid)
            return core.handle(identity, Hello(PROTOCOL_VERSION, 1, Role.TRAINER), 1)

        assert isinstance(hello(b"a", 100, 1000), Welcome)
        assert isinstance(hello(b"b", 101, 1000), Welcome)
        # Another process of the same user: refused, with what was exceeded and what to do.
        refused = hello(b"c", 102, 1000)
        assert isinstance(refused, Error) and refused.code is ErrorCode.RESOURCE_EXHAUSTED
        assert "uid 1000 already has 2 jobs" in refused.message
        assert "--max-jobs-per-user 2" in refused.message
        assert "close a job of yours first" in refused.message
        # The other user finds its share.
        assert isinstance(hello(b"d", 200, 0), Welcome)
        assert isinstance(hello(b"e", 201, 0), Welcome)
        # A job that ends gives its place back to its user.
        core.peer_disconnected(b"a")
        assert isinstance(hello(b"f", 103, 1000), Welcome)
    finally:
        core.close()


def test_a_job_registers_at_most_its_limit_of_pipelines() -> None:
    core = _limited_core({}, max_pipelines=1)
    try:
        core.handle(TRAINER, Hello(PROTOCOL_VERSION, 1, Role.TRAINER), 1)
        request = RegisterPipeline(memoryview(doubling().serialize()), ("x",), 1, 4, 1, 2)
        assert core.handle(TRAINER, request, 2) is None
        refused = core.handle(TRAINER, request, 3)
        assert isinstance(refused, Error) and refused.code is ErrorCode.RESOURCE_EXHAUSTED
        assert "already has 1 pipelines" in refused.message
    finally:
        core.close()


def test_batches_over_the_jobs_share_of_input_memory_are_refused(core: PushingCore) -> None:
    _hello(core)
    pipeline_id = _register(core)
    share = core.inputs.job_limit
    big = np.zeros(share // 4 + 1, np.int32)
    reply = core.handle(TRAINER, _batch(core, TRAINER, pipeline_id, big), 3)
    assert isinstance(reply, BatchFailed) and reply.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "--input-memory" in reply.message
    assert core.inputs.held == 0


def test_deferred_batches_are_bounded_too() -> None:
    core = PushingCore(
        Quotas(max_batch_size=64, pool_bytes=1 << 20, slab_bytes=1 << 16, max_waiting_batches=2)
    )
    try:
        _hello(core)
        pipeline_id = _register(core)
        sample = np.zeros((2, 3), np.int32)
        for rid in (3, 4):
            deferred = _batch(core, TRAINER, pipeline_id, sample, deferred=True)
            assert isinstance(core.handle(TRAINER, deferred, rid), BatchAccepted)
        # A deferred batch's sender waits for the answer: refused as an error, as before.
        refused = core.handle(TRAINER, _batch(core, TRAINER, pipeline_id, sample, deferred=True), 5)
        assert isinstance(refused, Error) and "2 deferred batches" in refused.message
        assert core.inputs.held == 2 * sample.nbytes
    finally:
        core.close()
    assert core.inputs.held == 0


# --- batch ids: chosen by the submitter, refused as data ------------------------------------------


def _joined_worker(core: PushingCore, identity: bytes, welcome: Welcome) -> Welcome:
    joined = _worker_hello(core, identity, welcome.job_id, welcome.job_token)
    assert isinstance(joined, Welcome)
    return joined


def test_each_connection_gets_a_range_of_batch_ids_of_its_own(core: PushingCore) -> None:
    welcome = _hello(core)
    worker = _joined_worker(core, WORKER, welcome)
    other = _joined_worker(core, b"other worker", welcome)
    bases = {welcome.batch_id_base, worker.batch_id_base, other.batch_id_base}
    assert len(bases) == 3 and all(base > 0 and base % (1 << 32) == 0 for base in bases)


def test_an_id_that_is_not_the_connections_next_is_refused_and_touches_nothing(
    core: PushingCore,
) -> None:
    welcome = _hello(core)
    pipeline_id = _register(core)
    worker = _joined_worker(core, WORKER, welcome)
    sample = np.zeros((2, 3), np.int32)
    taken = _batch(core, WORKER, pipeline_id, sample)
    assert isinstance(core.handle(WORKER, taken, 3), BatchAccepted)
    _, ready, _ = core.pushed.get(timeout=30)
    assert isinstance(ready, BatchReady) and ready.batch_id == taken.batch_id
    hostile = [
        0,  # no id
        taken.batch_id,  # its own, again
        taken.batch_id - 1,  # its own, below the last
        welcome.batch_id_base + 1,  # the trainer's
        worker.batch_id_base + (1 << 32),  # past its range: the next connection's
    ]
    for rid, batch_id in enumerate(hostile, start=4):
        request = dataclasses.replace(_batch(core, WORKER, pipeline_id, sample), batch_id=batch_id)
        reply = core.handle(WORKER, request, rid)
        assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_BATCH, batch_id
        assert f"batch id {batch_id} " in reply.message
    # Nothing ran, failed or reached the trainer, nor took input memory; the worker goes on.
    assert core.pushed.empty() and core.inputs.held <= sample.nbytes  # the first's, if not freed
    assert core.jobs[welcome.job_id].batches_failed == 0
    assert isinstance(
        core.handle(WORKER, _batch(core, WORKER, pipeline_id, sample), 9), BatchAccepted
    )
    _, ready, _ = core.pushed.get(timeout=30)
    assert isinstance(ready, BatchReady)


def test_another_jobs_trainer_cannot_schedule_a_deferred_batch(core: PushingCore) -> None:
    _hello(core)
    pipeline_id = _register(core)
    deferred = _batch(core, TRAINER, pipeline_id, np.zeros((1,), np.int32), deferred=True)
    assert isinstance(core.handle(TRAINER, deferred, 3), BatchAccepted)
    assert isinstance(_trainer_hello(core, b"other trainer"), Welcome)
    refused = core.handle(b"other trainer", ScheduleBatch(deferred.batch_id), 2)
    assert isinstance(refused, Error) and refused.code is ErrorCode.UNKNOWN_BATCH
    assert isinstance(core.handle(TRAINER, ScheduleBatch(deferred.batch_id), 4), Ok)
    peer, ready, _ = core.pushed.get(timeout=30)
    assert peer == TRAINER and isinstance(ready, BatchReady)
    assert ready.batch_id == deferred.batch_id


def test_a_workers_batch_refused_once_sent_fails_to_its_trainer(core: PushingCore) -> None:
    welcome = _hello(core)
    pipeline_id = _register(core)
    _joined_worker(core, WORKER, welcome)
    sample = np.zeros((2, 3), np.int32)
    too_big = _batch(core, WORKER, pipeline_id, *[sample] * 5)
    reply = core.handle(WORKER, too_big, 3)
    # The answer to the worker, and the same failure for the batch to its trainer.
    assert isinstance(reply, BatchFailed) and reply.batch_id == too_big.batch_id
    assert reply.code is ErrorCode.INVALID_BATCH and "max_batch_size" in reply.message
    assert core.pushed.get_nowait() == (TRAINER, reply, None)
    assert core.jobs[welcome.job_id].batches_failed == 1
    # A deferred batch's sender waits for the answer: an error to it, nothing to the trainer.
    deferred = _batch(core, WORKER, pipeline_id + 1, sample, deferred=True)
    refused = core.handle(WORKER, deferred, 4)
    assert isinstance(refused, Error) and refused.code is ErrorCode.UNKNOWN_PIPELINE
    assert core.pushed.empty()


def test_held_back_batches_of_a_worker_that_left_fail_to_its_trainer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core = PushingCore(
        Quotas(max_batch_size=64, pool_bytes=1 << 20, slab_bytes=1 << 16, max_inflight_batches=1)
    )
    try:
        welcome = _hello(core)
        pipeline_id = _register(core)
        _joined_worker(core, WORKER, welcome)
        # The job's one place stays taken once its first batch is done.
        monkeypatch.setattr(core.jobs[welcome.job_id].admission, "answered", lambda batch: None)
        sample = np.zeros((2, 3), np.int32)
        first, second = (_batch(core, WORKER, pipeline_id, sample) for _ in range(2))
        assert isinstance(core.handle(WORKER, first, 3), BatchAccepted)
        assert core.handle(WORKER, second, 4) is None  # held back
        core.peer_disconnected(WORKER)
        results: dict[int, BatchReady | BatchFailed] = {}
        left: list[WorkerLeft] = []
        while len(results) < 2:
            peer, message, _ = core.pushed.get(timeout=30)
            assert peer == TRAINER
            if isinstance(message, WorkerLeft):
                left.append(message)
                continue
            assert isinstance(message, BatchReady | BatchFailed)
            results[message.batch_id] = message
        # The trainer is told which batches the worker that left had sent.
        (told,) = left
        assert told.first_batch_id < first.batch_id < second.batch_id < told.end_batch_id
        assert isinstance(results[first.batch_id], BatchReady)
        dropped = results[second.batch_id]
        assert isinstance(dropped, BatchFailed) and dropped.code is ErrorCode.UNKNOWN_BATCH
        assert "worker that sent it" in dropped.message
    finally:
        core.close()


# --- the flight recorder's slots ------------------------------------------------------------------


class SlotWrites(FlightRecorder):
    """The recorder's slot writes, in order, in place of its file (which would also take over
    the test process's fault handler)."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, tuple[int, ...] | None]] = []

    def suspected(self, key: bytes, pid: int) -> None:
        return None

    def running(
        self, instance_id: int, key: bytes, pids: Iterable[int], name: str, *, solo: bool = False
    ) -> None:
        self.writes.append((instance_id, tuple(sorted(pids))))

    def idle(self, instance_id: int) -> None:
        self.writes.append((instance_id, None))

    def close(self) -> None:
        pass


def _core_of_two_trainers(
    recorder: FlightRecorder, other: bytes
) -> tuple[DaemonCore, queue.Queue[tuple[bytes, Message, int | None]]]:
    """A core whose trainers are TRAINER (pid 4242) and ``other`` (pid 4343), its flight
    recorder ``recorder``, and the queue of what it pushes."""
    credentials = {
        TRAINER: PeerCredentials(pid=4242, uid=0, gid=0),
        other: PeerCredentials(pid=4343, uid=0, gid=0),
    }
    pushed: queue.Queue[tuple[bytes, Message, int | None]] = queue.Queue()
    core = DaemonCore(
        "cpu",
        host_outputs(),
        lambda peer, message, rid: pushed.put((peer, message, rid)),
        Quotas(max_batch_size=64, pool_bytes=1 << 20, slab_bytes=1 << 16),
        instance=f"unittest-{uuid.uuid4().hex[:8]}",
        recorder=recorder,
        credentials=credentials.get,
    )
    return core, pushed


def test_a_pipeline_is_marked_running_once_a_busy_spell_and_names_a_job_that_joins_it() -> None:
    recorder = SlotWrites()
    other = b"trainer-2"
    core, pushed = _core_of_two_trainers(recorder, other)
    try:
        graph = memoryview(doubling().serialize())
        for identity in (TRAINER, other):
            hello = core.handle(identity, Hello(PROTOCOL_VERSION, 0, Role.TRAINER), 1)
            assert isinstance(hello, Welcome)
            if identity == other:
                # The pipeline holds runs when the second job registers the same graph.
                (executor,) = core.pipelines.instances.values()
                on_run = executor.runner._on_run if executor.runner else None
                assert on_run is not None
                on_run(True)
                on_run(True)  # a second run in DALI: nothing new to write
                assert recorder.writes[-1:] == [(executor.instance_id, (4242,))]
                writes = len(recorder.writes)
            reply = core.handle(identity, RegisterPipeline(graph, ("x",), 1, 4, 1, 2), 2)
            assert reply is None
            _, registered, _ = pushed.get(timeout=30)
            assert isinstance(registered, PipelineRegistered)
        # Named at once, not at the pipeline's next busy spell.
        assert recorder.writes[writes:] == [(executor.instance_id, (4242, 4343))]
        assert on_run is not None
        on_run(False)
        on_run(False)
        assert recorder.writes[writes + 1 :] == [(executor.instance_id, None)]
    finally:
        core.close()


@pipeline_def(batch_size=4, num_threads=1, device_id=None)
def tripling() -> DataNode:
    return fn.external_source(name="x") * 3


class OnProbation(FlightRecorder):
    """The recorder's marks, in order, with graph ``probation_key`` on probation for every
    trainer, in place of its file."""

    def __init__(self, probation_key: bytes) -> None:
        self.probation_key = probation_key
        self.marks: list[tuple[int, bool | None]] = []  # (instance, solo), None: idle
        self.cleared_for: list[tuple[bytes, int]] = []

    def suspected(self, key: bytes, pid: int) -> Suspect | None:
        if key != self.probation_key:
            return None
        return Suspect(key.hex(), pid, "tripling", 0.0, Standing.PROBATION)

    def running(
        self, instance_id: int, key: bytes, pids: Iterable[int], name: str, *, solo: bool = False
    ) -> None:
        self.marks.append((instance_id, solo))

    def idle(self, instance_id: int) -> None:
        self.marks.append((instance_id, None))

    def cleared(self, key: bytes, pid: int) -> None:
        self.cleared_for.append((key, pid))

    def close(self) -> None:
        pass


def test_a_pipeline_on_probation_runs_alone_in_dali_until_its_runs_clear_it() -> None:
    probation = tripling()
    serialized = memoryview(probation.serialize())
    recorder = OnProbation(graph_key("serialized", read_graph(bytes(serialized)).key))
    other = b"trainer-2"
    core, pushed = _core_of_two_trainers(recorder, other)
    try:
        pipelines = {}
        for identity, graph in ((TRAINER, doubling().serialize()), (other, serialized)):
            hello = core.handle(identity, Hello(PROTOCOL_VERSION, 0, Role.TRAINER), 1)
            assert isinstance(hello, Welcome)
            request = RegisterPipeline(memoryview(graph), ("x",), 1, 4, 1, 2)
            assert core.handle(identity, request, 2) is None
            _, registered, _ = pushed.get(timeout=30)
            assert isinstance(registered, PipelineRegistered)
            pipelines[identity] = registered.pipeline_id
        solo_instance = max(core.pipelines.instances)
        assert core.pipelines.instances[solo_instance].private_reason.startswith("on probation")
        rounds = PROBATION_RUNS + 4
        samples = [np.full((64, 64), 1, np.int32) for _ in range(4)]
        for _ in range(rounds):
            for identity, pipeline_id in pipelines.items():
                batch = _batch(core, identity, pipeline_id, *samples)
                assert isinstance(core.handle(identity, batch, 3), BatchAccepted)
            for _ in pipelines:
                peer, ready, _ = pushed.get(timeout=30)
                assert isinstance(ready, BatchReady), ready
                regions = tuple(output.region_id for output in ready.outputs)
                assert core.handle(peer, ReleaseRegions(regions), None) is None
        # Never a solo run in DALI beside another run; the next runs once it was cleared are
        # ordinary, and its trainer's probation ends.
        inside: dict[int, bool] = {}
        for instance_id, solo in recorder.marks:
            if solo is None:
                inside.pop(instance_id, None)
            else:
                inside[instance_id] = solo
            assert not any(inside.values()) or len(inside) == 1, recorder.marks
        solo_marks = [solo for instance, solo in recorder.marks if instance == solo_instance]
        assert solo_marks.count(True) == PROBATION_RUNS
        assert solo_marks[-2:] == [False, None]
        assert any(instance != solo_instance for instance, _ in recorder.marks)
        assert recorder.cleared_for == [(recorder.probation_key, 4343)]
    finally:
        core.close()
