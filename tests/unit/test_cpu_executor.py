"""Which DALI executor runs a CPU daemon's pipelines (``dalid serve --cpu-executor``,
docs/design/host-buffers.md): the legacy one by default, whatever the pipeline asked, so that
runs reuse their buffers; the pipeline's own with ``client``. Outputs are the same either way:
the whole suite and tests/conformance run on the default."""

from __future__ import annotations

import os
import queue
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from nvidia.dali import fn
from nvidia.dali.data_node import DataNode

from dalid.protocol import (
    PROTOCOL_VERSION,
    BatchAccepted,
    BatchReady,
    Hello,
    InputBatch,
    Message,
    PipelineRegistered,
    RegisterPipeline,
    Role,
    SubmitBatch,
    Welcome,
)
from dalid.server.handling.core import DaemonCore
from dalid.server.jobs.quotas import Quotas
from dalid.server.operations.config import parse_cpu_executor
from dalid.server.outputs.shm import host_outputs
from dalid.server.pipelines.spec import CpuExecutor

from ..dali_typing import pipeline_def

TRAINER = b"trainer"


@pipeline_def(batch_size=4, num_threads=1, device_id=None)
def doubling() -> DataNode:
    return fn.external_source(name="x") * 2


@pipeline_def(batch_size=4, num_threads=1, device_id=None, exec_dynamic=False)
def doubling_on_the_legacy_executor() -> DataNode:
    return fn.external_source(name="x") * 2


class Core(DaemonCore):
    def __init__(self, executor: CpuExecutor) -> None:
        self.pushed: queue.Queue[tuple[bytes, Message, int | None]] = queue.Queue()
        self.executor = executor
        super().__init__(
            "cpu",
            host_outputs(),
            lambda peer, message, rid: self.pushed.put((peer, message, rid)),
            Quotas(max_batch_size=64, pool_bytes=1 << 20, slab_bytes=1 << 16),
            instance=f"unittest-{uuid.uuid4().hex[:8]}",
            cpu_executor=executor,
        )


@pytest.fixture(params=list(CpuExecutor), ids=lambda executor: executor.value)
def core(request: pytest.FixtureRequest) -> Iterator[Core]:
    daemon = Core(request.param)
    yield daemon
    daemon.close()


def _dynamic_after_a_batch(core: Core, pipeline: object) -> bool:
    """Registers ``pipeline``, runs a batch through it; whether DALI's default executor ran it."""
    hello = core.handle(TRAINER, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER), 1)
    assert isinstance(hello, Welcome)
    serialized = memoryview(pipeline.serialize())  # type: ignore[attr-defined]
    dynamic = bool(pipeline.exec_dynamic)  # type: ignore[attr-defined]
    request = RegisterPipeline(serialized, ("x",), 1, 4, 1, 2, exec_dynamic=dynamic)
    assert core.handle(TRAINER, request, 2) is None
    _, registered, _ = core.pushed.get(timeout=30)
    assert isinstance(registered, PipelineRegistered)
    batch_id = core.peers[TRAINER].batch_ids.base + 1
    samples = [np.full((2, 3), i, np.int32) for i in range(3)]
    batch = SubmitBatch(registered.pipeline_id, (InputBatch.of("x", samples),), batch_id)
    assert isinstance(core.handle(TRAINER, batch, 3), BatchAccepted)
    _, ready, _ = core.pushed.get(timeout=30)
    assert isinstance(ready, BatchReady), ready
    (executor,) = core.pipelines.instances.values()
    assert executor.runner is not None
    return executor.runner.dynamic


def test_a_cpu_daemon_runs_a_pipeline_that_asked_for_the_default_executor_as_set(
    core: Core,
) -> None:
    asked = doubling()
    assert asked.exec_dynamic
    assert _dynamic_after_a_batch(core, asked) is (core.executor is CpuExecutor.CLIENT)


def test_a_pipeline_that_asked_for_the_legacy_executor_keeps_it(core: Core) -> None:
    assert _dynamic_after_a_batch(core, doubling_on_the_legacy_executor()) is False


def test_the_option_takes_the_two_names_and_refuses_others() -> None:
    assert [CpuExecutor(parse_cpu_executor(text)) for text in ("legacy", " Client ")] == [
        CpuExecutor.LEGACY,
        CpuExecutor.CLIENT,
    ]
    with pytest.raises(ValueError, match="expected legacy or client"):
        parse_cpu_executor("dynamic")
