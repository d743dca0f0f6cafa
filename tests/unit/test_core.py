"""DaemonCore without sockets: requests in, replies and pushes out (the real path is in
tests/integration)."""

from __future__ import annotations

import queue
import uuid

import numpy as np
import pytest
from nvidia.dali import fn, pipeline_def

from dalid.protocol import (
    PROTOCOL_VERSION,
    BatchAccepted,
    BatchReady,
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
from dalid.server.core import DaemonCore
from dalid.server.memory import SharedMemoryBackend
from dalid.server.quotas import Quotas

TRAINER = b"trainer"
WORKER = b"worker"


@pipeline_def(batch_size=4, num_threads=1, device_id=None)
def doubling():
    return fn.external_source(name="x") * 2


@pytest.fixture
def core():
    pushed: queue.Queue[tuple[bytes, Message, int | None]] = queue.Queue()
    quotas = Quotas(max_batch_size=64, pool_bytes=1 << 20, slab_bytes=1 << 16)
    daemon = DaemonCore(
        "cpu",
        SharedMemoryBackend(),
        lambda peer, message, rid: pushed.put((peer, message, rid)),
        quotas,
        instance=f"unittest-{uuid.uuid4().hex[:8]}",
    )
    daemon.pushed = pushed  # type: ignore[attr-defined]
    yield daemon
    daemon.close()


def _hello(core: DaemonCore) -> Welcome:
    import os

    reply = core.handle(TRAINER, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER), 1)
    assert isinstance(reply, Welcome)
    return reply


def _register(core: DaemonCore) -> int:
    pipe = doubling()
    request = RegisterPipeline(memoryview(pipe.serialize()), ("x",), 1, 4, 1, 2)
    assert core.handle(TRAINER, request, 2) is None  # built in the executor's thread
    peer, reply, rid = core.pushed.get(timeout=30)  # type: ignore[attr-defined]
    assert (peer, rid) == (TRAINER, 2)
    assert isinstance(reply, PipelineRegistered)
    return reply.pipeline_id


def _batch(pipeline_id: int, *samples: np.ndarray) -> SubmitBatch:
    return SubmitBatch(
        pipeline_id,
        (
            InputBatch(
                "x", "int32", tuple(s.shape for s in samples), tuple(map(memoryview, samples))
            ),
        ),
    )


def test_requests_before_hello_are_refused(core):
    reply = core.handle(TRAINER, ReleaseRegions((1,)), 1)
    assert isinstance(reply, Error) and reply.code is ErrorCode.NOT_WELCOMED


def test_a_batch_runs_and_its_regions_are_leased_until_released(core):
    _hello(core)
    pipeline_id = _register(core)
    samples = [np.full((2, 3), i, np.int32) for i in range(3)]
    accepted = core.handle(TRAINER, _batch(pipeline_id, *samples), 3)
    assert isinstance(accepted, BatchAccepted)
    peer, ready, rid = core.pushed.get(timeout=30)
    assert peer == TRAINER and rid is None and isinstance(ready, BatchReady)
    (output,) = ready.outputs
    assert output.shape == (3, 2, 3) and output.dtype == "int32"
    job = core.jobs[1]
    assert job.pool.leased_regions == 1
    assert core.handle(TRAINER, ReleaseRegions((output.region_id,)), None) is None
    assert job.pool.leased_regions == 0
    # A second release of the same region is an error, and changes nothing.
    again = core.handle(TRAINER, ReleaseRegions((output.region_id,)), None)
    assert isinstance(again, Error) and again.code is ErrorCode.UNKNOWN_REGION


def test_bad_batches_are_refused_before_they_are_queued(core):
    _hello(core)
    pipeline_id = _register(core)
    sample = np.zeros((2, 3), np.int32)
    unknown = core.handle(TRAINER, _batch(pipeline_id + 1, sample), 3)
    assert isinstance(unknown, Error) and unknown.code is ErrorCode.UNKNOWN_PIPELINE
    too_big = core.handle(TRAINER, _batch(pipeline_id, *[sample] * 5), 4)
    assert isinstance(too_big, Error) and "max_batch_size" in too_big.message
    wrong_size = SubmitBatch(
        pipeline_id, (InputBatch("x", "int32", ((2, 4),), (memoryview(sample),)),)
    )
    reply = core.handle(TRAINER, wrong_size, 5)
    assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_BATCH
    assert "needs 32 bytes" in reply.message
    wrong_name = SubmitBatch(
        pipeline_id, (InputBatch("y", "int32", ((2, 3),), (memoryview(sample),)),)
    )
    reply = core.handle(TRAINER, wrong_name, 6)
    assert isinstance(reply, Error) and "takes ['x']" in reply.message


def test_a_worker_needs_the_job_token(core):
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


def test_goodbye_frees_the_job(core):
    from dalid.protocol import Goodbye

    _hello(core)
    pipeline_id = _register(core)
    core.handle(TRAINER, _batch(pipeline_id, np.zeros((1,), np.int32)), 3)
    core.pushed.get(timeout=30)
    pool = core.jobs[1].pool
    assert pool.slab_count == 1
    core.handle(TRAINER, Goodbye(), 4)
    assert not core.jobs and not core.peers
    assert pool.slab_count == 0
