"""A DALI instance's run loop alone (server/runs/run_loop.py): a run that fails in DALI has the
pipeline rebuilt and the batches of a mixed run run again one by one, each delivered to its own
job. The runner here is scripted (its outputs are real DALI tensor lists, its failure made up);
the same recovery on real pipelines is in tests/integration/test_bad_samples.py and
tests/integration/test_shared_pipelines.py."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from nvidia.dali.backend import TensorListCPU

from dalid.protocol import BatchReady, InputBatch, Limits, OnError, SubmitBatch
from dalid.server.outputs.job_outputs import JobOutputs
from dalid.server.outputs.shm import host_outputs
from dalid.server.runs.dali_instances import DaliInstances, Instance
from dalid.server.runs.delivery import Delivery
from dalid.server.runs.run_gate import RunGate
from dalid.server.runs.run_loop import RunLoop
from dalid.server.runs.run_planner import RunPlanner
from dalid.server.runs.runs import Member, PendingBatch, Run
from dalid.server.runs.scheduler import ServiceClock

SAMPLES = 4
PAGE = 4096
LIMITS = Limits(
    max_batch_size=64, max_message_bytes=1 << 20, pool_bytes=16 * PAGE, slab_bytes=4 * PAGE
)


class _Runner:
    """Runs of one output, a row of the sample's first value per sample; its first
    ``failures`` collects fail as DALI's do. ``depth`` runs go into it at once; as DALI's
    legacy executor (``dynamic`` False), it raises a failure at the next collect, whichever
    run failed."""

    def __init__(self, failures: int, depth: int = 1, dynamic: bool = True) -> None:
        self.spec = SimpleNamespace(prefetch_queue_depth=depth)
        self.dynamic = dynamic
        self.failures = failures
        self.runs: list[list[int]] = []
        self.rebuilds = 0
        self._inside: list[np.ndarray] = []

    @property
    def scheduled(self) -> bool:
        return bool(self._inside)

    def schedule(self, arrays: dict[str, Any]) -> None:
        samples = np.asarray(arrays["x"])
        self.runs.append([int(row[0]) for row in samples])
        self._inside.append(samples)

    def collect(self, stream: int | None = None) -> tuple[TensorListCPU, ...]:
        samples = self._inside.pop(0)
        if self.failures:
            self.failures -= 1
            raise RuntimeError("Critical error in pipeline")
        rows = np.repeat(samples[:, :1].astype(np.float32), PAGE // 4, axis=1)
        return (TensorListCPU(rows),)

    def release(self) -> None:
        pass

    def rebuild(self) -> None:
        self.rebuilds += 1
        self._inside.clear()


class _Pipeline:
    """What the loop asks of its pipeline's executor: the real planner, delivery and
    instances, with no controller and no scheduler."""

    instance_id = 1
    failed = False

    def __init__(self) -> None:
        self.clock = ServiceClock()
        self.stopping = threading.Event()
        self.planner = RunPlanner(None, self.clock, self.stopping, 1000)
        self.planner.shared = True
        self.planner.run_size = 2 * SAMPLES
        self.delivery = Delivery(self.instance_id, self.planner, self.stopping)
        self.instances = DaliInstances(self.instance_id, "scripted", lambda running: None)
        self.accounted: list[Run] = []
        self.gate = RunGate()
        self.solo = False

    def look(self) -> None:
        pass

    def ran_solo(self) -> None:
        pass

    def account(self, run: Run) -> None:
        self.accounted.append(run)


@pytest.fixture
def jobs() -> Iterator[list[JobOutputs]]:
    made = [
        host_outputs()(f"dalid-unittest-{os.getpid()}-{os.urandom(3).hex()}", LIMITS)
        for _ in range(2)
    ]
    yield made
    for outputs in made:
        outputs.close()
        outputs.free()


def _run_until_stopped(pipeline: _Pipeline, runner: _Runner) -> None:
    """Runs the loop in its own thread until the test's answers stop it."""
    thread = threading.Thread(
        target=RunLoop(pipeline, Instance(), runner).run,  # type: ignore[arg-type]
        daemon=True,
    )
    thread.start()
    thread.join(30)
    assert not thread.is_alive()


def _batch(member: Member, value: int) -> PendingBatch:
    item = InputBatch.of("x", [np.full(3, value, np.uint8)] * SAMPLES)
    return PendingBatch(value, SubmitBatch(1, (item,)), member)


def test_a_mixed_run_that_fails_runs_again_batch_by_batch_each_to_its_own_job(
    jobs: Sequence[JobOutputs],
) -> None:
    pipeline = _Pipeline()
    answers: dict[int, list[Any]] = {1: [], 2: []}

    def answer(job_id: int) -> Any:
        def answered(batch: PendingBatch, result: Any) -> None:
            answers[job_id].append(result)
            if all(answers.values()):
                pipeline.stopping.set()

        return answered

    members = [
        Member(job_id, 1, outputs, answer(job_id), OnError.RAISE)
        for job_id, outputs in zip((1, 2), jobs, strict=True)
    ]
    for member in members:
        pipeline.planner.add(member)
    pipeline.planner.submit(_batch(members[0], 10))
    pipeline.planner.submit(_batch(members[1], 20))
    runner = _Runner(failures=1)
    _run_until_stopped(pipeline, runner)
    # The mixed run failed; its batches ran again alone, in their order, on a rebuilt pipeline.
    assert runner.runs == [[10] * SAMPLES + [20] * SAMPLES, [10] * SAMPLES, [20] * SAMPLES]
    assert runner.rebuilds == 1
    assert [len(run.batches) for run in pipeline.accounted] == [1, 1]
    for job_id in (1, 2):
        (ready,) = answers[job_id]
        assert isinstance(ready, BatchReady) and ready.batch_id == job_id * 10


def test_a_failure_under_the_legacy_executor_is_found_out_one_run_at_a_time(
    jobs: Sequence[JobOutputs],
) -> None:
    """Two runs in DALI, the second bad: the legacy executor raises its failure at the first's
    collect. Neither is answered with it; both run again one at a time, and each gets its own
    outcome (here the failure was once: both are delivered)."""
    pipeline = _Pipeline()
    pipeline.planner.shared = False
    pipeline.planner.run_size = SAMPLES
    answers: list[Any] = []

    def answered(batch: PendingBatch, result: Any) -> None:
        answers.append(result)
        if len(answers) == 2:
            pipeline.stopping.set()

    member = Member(1, 1, jobs[0], answered, OnError.RAISE)
    pipeline.planner.add(member)
    runner = _Runner(failures=0, depth=2, dynamic=False)
    inside = runner.schedule

    def schedule(arrays: dict[str, Any]) -> None:
        inside(arrays)
        if len(runner.runs) == 2:  # the second run fails, seen at the first's collect
            runner.failures = 1

    runner.schedule = schedule  # type: ignore[method-assign]
    pipeline.planner.submit(_batch(member, 10))
    pipeline.planner.submit(_batch(member, 20))
    _run_until_stopped(pipeline, runner)
    one, two = [10] * SAMPLES, [20] * SAMPLES
    assert runner.runs == [one, two, one, two]
    assert runner.rebuilds == 1
    assert [type(answer) for answer in answers] == [BatchReady, BatchReady], answers
    assert [answer.batch_id for answer in answers] == [10, 20]
