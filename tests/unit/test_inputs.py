"""The daemon's count of the batch inputs it holds."""

from __future__ import annotations

import gc

import pytest

from dalid.server.jobs.inputs import InputMemory, InputRefused


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
