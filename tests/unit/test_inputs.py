"""The daemon's count of the batch inputs it holds."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from dalid.protocol import InputBatch, SubmitBatch
from dalid.server.jobs.inputs import InputMemory, InputRefused
from dalid.server.runs.runs import PendingBatch


class Batch:
    """Stands for a PendingBatch: what holds the frames."""


def test_a_batch_counts_until_it_is_freed() -> None:
    memory = InputMemory(limit=1000)
    batch = Batch()
    memory.take(1, 300, holder=batch)
    assert memory.held == memory.held_by(1) == 300
    del batch
    gc.collect()
    assert memory.held == memory.held_by(1) == 0


def test_a_batch_given_back_early_counts_once() -> None:
    # A delivered batch gives its inputs back while its job's window still holds it.
    memory = InputMemory(limit=1000)
    batch = Batch()
    give_back = memory.take(1, 300, holder=batch)
    give_back()
    assert memory.held == memory.held_by(1) == 0
    give_back()
    del batch
    gc.collect()
    assert memory.held == 0
    memory.take(1, 500, holder=Batch())  # the job's whole share is its own again


def test_a_delivered_batch_keeps_its_ids_and_size_not_its_samples() -> None:
    request = SubmitBatch(
        3,
        (InputBatch.of("data", [np.zeros((64, 64), np.float32)] * 4),),
        batch_id=77,
        unreadable=(1,),
    )
    batch = PendingBatch(request.batch_id, request)
    memory = InputMemory(limit=1 << 20)
    batch.give_back_inputs = memory.take(1, request.inputs[0].nbytes, holder=batch)
    batch.drop_samples()
    assert memory.held == 0
    assert (batch.size, batch.request.batch_id, batch.request.pipeline_id) == (4, 77, 3)
    assert batch.request.unreadable == (1,)
    assert sum(item.nbytes for item in batch.request.inputs) == 0
    assert not batch.arrays


def test_a_job_holds_at_most_half() -> None:
    memory = InputMemory(limit=1000)
    kept = [Batch(), Batch()]
    memory.take(1, 400, holder=kept[0])
    with pytest.raises(
        InputRefused, match=r"job 1 holds 400 B .* half the daemon's --input-memory 1000 B"
    ):
        memory.take(1, 101, holder=Batch())
    assert memory.held_by(1) == 400  # the refused batch counts for nothing
    memory.take(2, 500, holder=kept[1])  # another job has its own half


def test_all_jobs_together_hold_at_most_the_limit() -> None:
    memory = InputMemory(limit=1000)
    kept = [Batch() for _ in range(3)]
    memory.take(1, 450, holder=kept[0])
    memory.take(2, 450, holder=kept[1])
    with pytest.raises(InputRefused, match=r"the daemon holds 900 B .* --input-memory 1000 B"):
        memory.take(3, 200, holder=kept[2])
    del kept[0]
    gc.collect()
    memory.take(3, 200, holder=kept[1])
    assert memory.held == 650


def test_the_peak_sees_a_batch_that_came_and_went_between_two_looks() -> None:
    # The daemon gives freed memory back after a drop from the peak; a flood may come and go
    # within one of its ticks.
    memory = InputMemory(limit=1000)
    kept = Batch()
    memory.take(1, 100, holder=kept)
    batch = Batch()
    memory.take(2, 400, holder=batch)
    del batch
    gc.collect()
    assert memory.held == 100
    assert memory.take_peak() == 500
    assert memory.take_peak() == 100  # the next span starts at what is held
