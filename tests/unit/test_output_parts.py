"""Parts of a job's outputs and of the pipelines' bookkeeping, alone: delivered batches, whose
callback fires once a batch is all back; private copies' choice of copy memory; and the budget of
DALI threads and pipelines."""

from __future__ import annotations

import functools
import threading

import pytest

from dalid.protocol import ErrorCode
from dalid.server.errors import RequestRefused
from dalid.server.handling.budget import BudgetFull, Holding, PipelineBudget
from dalid.server.jobs.quotas import Full
from dalid.server.outputs.copies import PrivateCopies
from dalid.server.outputs.delivered import DeliveredBatches
from dalid.server.outputs.pool import RegionPool
from dalid.server.outputs.shm import SharedMemoryBackend

# --- delivered batches ------------------------------------------------------------------------


def test_a_delivered_batch_is_released_once_all_its_regions_are_back() -> None:
    released: list[str] = []
    delivered = DeliveredBatches()
    assert not delivered
    delivered.add([1, 2, 3], lambda: released.append("a"))
    delivered.add([4], lambda: released.append("b"))
    delivered.released([1, 4, 99])  # 99: no batch's region, ignored
    assert released == ["b"]
    delivered.released([2])
    assert released == ["b"]
    delivered.released([3, 3])  # a region released twice counts once
    assert released == ["b", "a"] and not delivered


def test_no_batch_is_released_after_the_job_ended() -> None:
    released: list[int] = []
    delivered = DeliveredBatches()
    delivered.add([1], lambda: released.append(1))
    delivered.clear()
    delivered.released([1])
    assert released == [] and not delivered


def test_releases_from_several_threads_call_each_batch_once() -> None:
    calls: list[int] = []
    delivered = DeliveredBatches()
    for batch in range(100):
        delivered.add([2 * batch + 1, 2 * batch + 2], functools.partial(calls.append, batch))
    threads = [
        threading.Thread(target=delivered.released, args=(list(range(first, 201, 2)),))
        for first in (1, 2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(calls) == list(range(100))


# --- private copies ---------------------------------------------------------------------------


class _CopyMemory:
    """What private copies read of the store that keeps GPU copies: its kind and copy pool."""

    device = "cuda"

    def __init__(self) -> None:
        self.copy_pool = RegionPool(SharedMemoryBackend(), "dalid-test-copies", 0, 0)


def test_copies_go_through_the_host_once_their_store_is_replaced() -> None:
    store = _CopyMemory()
    try:
        copies = PrivateCopies(store)  # type: ignore[arg-type]
        pools = [copies.pool]
        copies.forget(object())  # another store of the job: nothing changes
        pools.append(copies.pool)
        copies.forget(store)  # staged outputs took its place
        pools += [copies.pool, PrivateCopies().pool]
        assert pools == [store.copy_pool, store.copy_pool, None, None]
        assert copies.on_device is None
    finally:
        store.copy_pool.close()


# --- the budget of DALI threads and pipelines -------------------------------------------------


def test_a_pipeline_gets_the_threads_left_up_to_its_share() -> None:
    budget = PipelineBudget(max_threads=6)
    share = budget.room()
    assert 1 <= share <= 6
    budget.add(1, share)
    assert budget.threads == {1: share}
    if share < 6:
        assert budget.room() == min(share, 6 - share)


def test_no_pipeline_starts_past_the_threads_or_the_pipelines_limit() -> None:
    budget = PipelineBudget(max_threads=2, max_pipelines=2)
    budget.add(1, 2)
    with pytest.raises(RequestRefused, match="--max-threads") as refused:
        budget.room()
    assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED
    budget = PipelineBudget(max_threads=100, max_pipelines=2)
    budget.add(1, 1)
    budget.add(2, 1)
    with pytest.raises(RequestRefused, match="--max-daemon-pipelines"):
        budget.room()


def test_one_user_holds_at_most_its_share_of_the_pipelines_and_threads() -> None:
    budget = PipelineBudget(max_threads=100, max_pipelines=4, user_share=0.5)
    budget.add(1, 1, uid=1000)
    budget.add(2, 1, uid=1000)
    with pytest.raises(RequestRefused, match="uid 1000 already runs 2 pipelines") as refused:
        budget.room(1000)
    assert "--max-jobs-per-user" in str(refused.value)
    assert budget.take(1) == 0  # another DALI instance would pass the share too
    assert budget.room(0) >= 1  # the other user finds room
    budget.forget(2)
    assert budget.room(1000) >= 1  # a pipeline that ends gives its place back
    # Threads: one user's pipelines hold at most half of them.
    budget = PipelineBudget(max_threads=4, max_pipelines=0, user_share=0.5)
    budget.add(1, 2, uid=1000)
    with pytest.raises(RequestRefused, match="uid 1000's pipelines already have 2 DALI threads"):
        budget.room(1000)
    assert budget.room(0) >= 1
    budget.add(2, 1, uid=0)
    assert budget.room(0) == 1  # root's share is 2 threads, 1 of them held


def test_a_full_budget_says_which_limit_and_what_pipelines_hold_of_it() -> None:
    """What reclaiming reads: which limit refused (the uid's share first, since ending one of
    the uid's jobs frees the daemon's limit too), and what given pipelines hold of it."""
    budget = PipelineBudget(max_threads=100, max_pipelines=4, user_share=0.5)
    budget.add(1, 3, uid=1000)
    budget.add(2, 2, uid=1000)
    budget.add(3, 1, uid=0)
    assert budget.take(3) == 1
    with pytest.raises(BudgetFull) as refused:
        budget.room(1000)
    assert (refused.value.full, refused.value.holding) == (Full.USER, Holding.PIPELINES)
    assert str(refused.value).startswith(f"{refused.value.what}: ")
    with pytest.raises(BudgetFull) as refused:
        budget.room(500)  # a uid holding none: the daemon's 4 are full
    assert (refused.value.full, refused.value.holding) == (Full.DAEMON, Holding.PIPELINES)
    assert budget.held([1, 3], Holding.PIPELINES) == 3  # pipeline 3 runs 2 DALI instances
    assert budget.held([1, 3], Holding.THREADS) == 5
    assert budget.held([1, 3], Holding.PIPELINES, uid=1000) == 1  # of uid 1000's share
    assert budget.held([1, 3, 9], Holding.THREADS, uid=0) == 2  # 9: none, or ended
    budget = PipelineBudget(max_threads=2)
    budget.add(1, 2, uid=1000)
    with pytest.raises(BudgetFull) as refused:
        budget.room(1000)
    assert (refused.value.full, refused.value.holding) == (Full.DAEMON, Holding.THREADS)


def test_another_instance_takes_its_first_ones_threads_and_gives_them_back() -> None:
    budget = PipelineBudget(max_threads=10, max_pipelines=3)
    budget.add(1, 4)
    assert budget.take(1) == 4 and budget.threads == {1: 8}
    assert budget.take(1) == 0  # 2 threads left, fewer than an instance has
    assert budget.take(7) == 0  # no such pipeline
    budget.give(1, 4)
    assert budget.threads == {1: 4}
    budget.add(2, 1)
    assert budget.take(2) == 1  # the third DALI instance: the limit
    assert budget.take(1) == 0
    budget.forget(1)
    budget.forget(2)
    assert budget.threads == {}
    assert budget.room() >= 1
