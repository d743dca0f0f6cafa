"""A job's in-flight limit (dalid.server.jobs.admission): batches over it wait, in arrival order,
except the one the trainer waits for, which passes it by one. The real path, a trainer that
waits for a batch held back by the limit, is in tests/integration/test_window.py."""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from dalid.protocol import InputBatch, SubmitBatch
from dalid.server.jobs.admission import Admission
from dalid.server.runs.executor import PipelineExecutor
from dalid.server.runs.runs import PendingBatch


class Executor:
    """What admission asks of an executor: that it take a batch."""

    def __init__(self) -> None:
        self.submitted: list[int] = []

    def submit(self, batch: PendingBatch) -> None:
        self.submitted.append(batch.batch_id)


def batch(batch_id: int) -> PendingBatch:
    request = SubmitBatch(1, (InputBatch.of("x", [np.zeros(1, np.int32)]),), batch_id)
    return PendingBatch(batch_id, request)


def submit_all(admission: Admission, executor: Any, ids: range) -> dict[int, PendingBatch]:
    batches = {batch_id: batch(batch_id) for batch_id in ids}
    for pending in batches.values():
        admission.submit(pending, cast(PipelineExecutor, executor), b"worker", pending.batch_id)
    return batches


def test_batches_over_the_limit_wait_in_arrival_order() -> None:
    admission, executor = Admission(1, max_inflight=2, max_waiting=8), Executor()
    batches = submit_all(admission, executor, range(1, 6))
    assert executor.submitted == [1, 2] and admission.waiting == 3
    admitted = admission.answered(batches[1])
    assert admitted is not None and admitted.batch.batch_id == 3
    assert (admitted.sender, admitted.request_id) == (b"worker", 3)
    assert executor.submitted == [1, 2, 3]


def test_the_wanted_batch_passes_the_limit_by_one() -> None:
    admission, executor = Admission(1, max_inflight=2, max_waiting=8), Executor()
    batches = submit_all(admission, executor, range(1, 6))
    wanted = admission.want(5)
    assert wanted is not None and wanted.batch.batch_id == 5 and wanted.batch.counted
    assert executor.submitted == [1, 2, 5] and admission.waiting == 2
    # One over the limit at most: another want waits until a batch in flight is answered.
    assert admission.want(4) is None
    # Answered, the first leaves the job at its limit again: nothing comes in its place.
    assert admission.answered(batches[1]) is None
    assert admission.want(4) is not None
    assert executor.submitted == [1, 2, 5, 4]
    assert admission.answered(batches[2]) is None  # 5 and 4 in flight: the limit
    admitted = admission.answered(batches[5])
    assert admitted is not None and admitted.batch.batch_id == 3


def test_a_want_for_a_batch_not_held_back_changes_nothing() -> None:
    admission, executor = Admission(1, max_inflight=2, max_waiting=8), Executor()
    submit_all(admission, executor, range(1, 4))
    assert admission.want(1) is None  # in flight already
    assert admission.want(99) is None  # never submitted
    assert executor.submitted == [1, 2] and admission.waiting == 1


def test_a_closed_admission_admits_no_wanted_batch() -> None:
    admission, executor = Admission(1, max_inflight=1, max_waiting=8), Executor()
    submit_all(admission, executor, range(1, 3))
    assert [waiting.batch.batch_id for waiting in admission.close()] == [2]
    assert admission.want(2) is None
