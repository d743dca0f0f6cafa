"""A shared pipeline's executor carries out its controller's changes: one more DALI instance
(its threads taken from the daemon's), runs on it, and one fewer once its runs are done (its
threads given back), with every batch answered throughout. An in-process core with real DALI
pipelines; the controller is scripted here, its own decisions are in test_instances.py and a
real daemon on two instances is in tests/integration/test_instances.py."""

from __future__ import annotations

import collections
import itertools
import os
import queue
import threading
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from dalid.protocol import (
    PROTOCOL_VERSION,
    BatchAccepted,
    BatchReady,
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
from dalid.server.jobs.quotas import Quotas
from dalid.server.outputs.shm import host_outputs
from dalid.server.runs.executor import PipelineExecutor
from dalid.server.runs.instances import Change, InstanceController, Load

from ..daemons import wait_for
from .test_core import doubling

TRAINER = b"trainer"


class Scripted(InstanceController):
    """A controller that makes the changes the test queues, one a look."""

    def __init__(self) -> None:
        super().__init__(max_instances=4)
        self.script: collections.deque[Change] = collections.deque()
        self.starts = 0

    def observe(self, now: float, instances: int, load: Load) -> Change | None:
        if not self.script:
            return None
        change = self.script.popleft()
        self.reason = f"{instances} instances: scripted {change.value}"
        return change

    def started(self, now: float) -> None:
        self.starts += 1


class Core(DaemonCore):
    def __init__(self) -> None:
        self.pushed: queue.Queue[tuple[bytes, Message, int | None]] = queue.Queue()
        super().__init__(
            "cpu",
            host_outputs(),
            lambda peer, message, rid: self.pushed.put((peer, message, rid)),
            Quotas(max_batch_size=64, pool_bytes=1 << 20, slab_bytes=1 << 16),
            instance=f"unittest-{uuid.uuid4().hex[:8]}",
        )


@pytest.fixture
def core() -> Iterator[Core]:
    daemon = Core()
    yield daemon
    daemon.close()


_ids = itertools.count(1)


def _run_batches(core: Core, pipeline_id: int, count: int) -> None:
    """Submits ``count`` batches and checks each comes back doubled, releasing its regions."""
    sent = {}
    for _ in range(count):
        batch_id = core.peers[TRAINER].batch_ids.base + next(_ids)
        value = batch_id % 1000
        samples = [np.full((2,), value + i, np.int32) for i in range(4)]
        request = SubmitBatch(pipeline_id, (InputBatch.of("x", samples),), batch_id)
        assert isinstance(core.handle(TRAINER, request, None), BatchAccepted)
        sent[batch_id] = value
    while sent:
        _, ready, _ = core.pushed.get(timeout=30)
        assert isinstance(ready, BatchReady), ready
        assert sent.pop(ready.batch_id, None) is not None
        regions = tuple(output.region_id for output in ready.outputs)
        assert core.handle(TRAINER, ReleaseRegions(regions), None) is None


def test_an_instance_added_runs_batches_and_one_dropped_gives_its_threads_back(
    core: Core,
) -> None:
    reply = core.handle(TRAINER, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER), 1)
    assert isinstance(reply, Welcome)
    request = RegisterPipeline(memoryview(doubling().serialize()), ("x",), 1, 4, 1, 2)
    assert core.handle(TRAINER, request, 2) is None
    _, registered, _ = core.pushed.get(timeout=30)
    assert isinstance(registered, PipelineRegistered)
    (executor,) = core.pipelines.instances.values()
    assert isinstance(executor, PipelineExecutor) and executor.shared
    threads_before = dict(core.pipelines.budget.threads)
    depth = executor.spec.prefetch_queue_depth if executor.spec else 0
    # A job's window: one instance's prefetch and the batch its trainer holds.
    assert executor.planner.window == depth + 1
    controller = Scripted()
    executor.instances.controller = controller

    controller.script.append(Change.ADD)
    wait_for(lambda: controller.starts == 1, 30, "the second instance to be built")
    status = executor.status()
    assert status.instances == 2 and status.instances_reason == "1 instances: scripted add"
    assert (
        core.pipelines.budget.threads[executor.instance_id]
        == 2 * threads_before[executor.instance_id]
    )
    # A job alone keeps both instances' prefetch busy: its window holds both.
    assert executor.planner.window == 2 * depth + 1
    # Both instances take batches from the same queues until each has run some.
    for _ in range(50):
        _run_batches(core, registered.pipeline_id, 8)
        if all(executor.status().instance_runs):
            break
    assert all(executor.status().instance_runs), executor.status()

    controller.script.append(Change.DROP)
    wait_for(lambda: len(executor.status().instance_runs) == 1, 30, "the instance to go")
    wait_for(
        lambda: core.pipelines.budget.threads == threads_before, 30, "its threads to be given back"
    )
    assert f"dalid-pipeline-{executor.instance_id}.1" not in {
        thread.name for thread in threading.enumerate()
    }
    _run_batches(core, registered.pipeline_id, 8)
    assert executor.status().instances == 1
    assert executor.planner.window == depth + 1
