"""FairScheduler: weighted shares, no saved-up credit, no queue jumping, cancellation.

The real path (executors of several jobs in one daemon) is in tests/integration/test_many_jobs.py.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from dalid.server.scheduler import FairScheduler


def never() -> bool:
    return False


def _serve_backlogged(
    scheduler: FairScheduler, costs: dict[int, int], grants: int
) -> dict[int, int]:
    """Samples each job gets when all of them always have a batch waiting.

    One slot; each job's executor runs one batch at a time and, as a real one does, says at
    release that it has another ready. Returns the samples served per job over ``grants``.
    """
    served = dict.fromkeys(costs, 0)
    order: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()

    def executor(job_id: int) -> None:
        while not stop.is_set():
            if not scheduler.acquire(job_id, costs[job_id], block=True, cancelled=stop.is_set):
                return
            with lock:
                order.append(job_id)
                served[job_id] += costs[job_id]
                done = len(order) >= grants
            if done:
                stop.set()
            scheduler.release(job_id, next_cost=costs[job_id])

    # The first slot is taken until every executor waits, so grants follow the tags alone.
    first = next(iter(costs))
    assert scheduler.acquire(first, 0, block=False, cancelled=never)
    threads = [threading.Thread(target=executor, args=(job_id,)) for job_id in costs]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    scheduler.release(first)
    for thread in threads:
        thread.join(10)
    return served


def test_busy_jobs_share_samples_by_weight() -> None:
    scheduler = FairScheduler(1)
    scheduler.add_job(1, weight=1.0)
    scheduler.add_job(2, weight=3.0)
    served = _serve_backlogged(scheduler, {1: 8, 2: 8}, grants=400)
    assert served[2] / served[1] == pytest.approx(3.0, rel=0.1)


def test_shares_count_samples_not_batches() -> None:
    # A job with batches four times larger gets a quarter as many of them.
    scheduler = FairScheduler(1)
    scheduler.add_job(1, weight=1.0)
    scheduler.add_job(2, weight=1.0)
    served = _serve_backlogged(scheduler, {1: 32, 2: 8}, grants=400)
    assert served[1] / served[2] == pytest.approx(1.0, rel=0.1)


def test_an_idle_job_does_not_save_up_credit() -> None:
    scheduler = FairScheduler(1)
    scheduler.add_job(1, weight=1.0)
    for _ in range(100):  # job 1 alone for a while
        assert scheduler.acquire(1, 10, block=False, cancelled=never)
        scheduler.release(1)
    scheduler.add_job(2, weight=1.0)
    # Job 2 starts at the current virtual time: from here on the two alternate, rather than
    # job 2 taking 100 turns in a row to "catch up".
    scheduler.acquire(1, 10, block=False, cancelled=never)
    turns: list[int] = []
    threads = []
    for job_id in (1, 2):

        def run(job_id: int = job_id) -> None:
            for _ in range(5):
                assert scheduler.acquire(job_id, 10, block=True, cancelled=never)
                turns.append(job_id)
                time.sleep(0.005)
                scheduler.release(job_id)

        threads.append(threading.Thread(target=run))
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    scheduler.release(1)
    for thread in threads:
        thread.join(10)
    assert sorted(turns) == [1] * 5 + [2] * 5
    assert max(len(list(run)) for _, run in itertools.groupby(turns)) <= 2


def test_a_freed_slot_goes_to_the_waiting_job_not_to_the_next_try() -> None:
    scheduler = FairScheduler(2)
    scheduler.add_job(1, weight=1.0)
    scheduler.add_job(2, weight=1.0)
    assert scheduler.acquire(1, 10, block=False, cancelled=never)
    assert scheduler.acquire(1, 10, block=False, cancelled=never)
    granted = threading.Event()

    def steady() -> None:
        if scheduler.acquire(2, 10, block=True, cancelled=never):
            granted.set()

    thread = threading.Thread(target=steady)
    thread.start()
    time.sleep(0.05)
    scheduler.release(1)
    thread.join(5)
    assert granted.is_set()
    # The flooding job's next try finds no slot: it collects what it has in flight instead.
    assert not scheduler.acquire(1, 10, block=False, cancelled=never)
    assert scheduler.stats(1).running == 1 and scheduler.stats(2).running == 1


def test_a_blocked_request_returns_false_when_cancelled_or_its_job_ends() -> None:
    scheduler = FairScheduler(1)
    scheduler.add_job(1, weight=1.0)
    scheduler.add_job(2, weight=1.0)
    assert scheduler.acquire(1, 1, block=False, cancelled=never)
    cancel = threading.Event()
    results: list[bool] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                scheduler.acquire(2, 1, block=True, cancelled=cancel.is_set)
            )
        ),
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    cancel.set()
    threads[0].join(5)
    assert results == [False]

    ended = threading.Thread(
        target=lambda: results.append(scheduler.acquire(2, 1, block=True, cancelled=never))
    )
    ended.start()
    time.sleep(0.05)
    scheduler.remove_job(2)
    ended.join(5)
    assert results == [False, False]
    # The slot job 1 holds is still its own; removing job 1 gives it back.
    assert scheduler.free == 0
    scheduler.remove_job(1)
    assert scheduler.free == 1


def test_passed_over_counts_other_jobs_batches_started_meanwhile() -> None:
    scheduler = FairScheduler(1)
    for job_id in (1, 2, 3):
        scheduler.add_job(job_id, weight=1.0)
    assert scheduler.acquire(1, 1, block=False, cancelled=never)
    waiters = [
        threading.Thread(
            target=scheduler.acquire, args=(job_id, 1), kwargs={"block": True, "cancelled": never}
        )
        for job_id in (2, 3)
    ]
    waiters[0].start()
    time.sleep(0.05)
    waiters[1].start()
    time.sleep(0.05)
    scheduler.release(1)  # job 2 (waited first, same tag) goes next; job 3 is passed over
    waiters[0].join(5)
    scheduler.release(2)
    waiters[1].join(5)
    assert scheduler.stats(2).passed_over == 0
    assert scheduler.stats(3).passed_over == 1
    assert scheduler.stats(3).waited_seconds > 0


def test_weights_must_be_positive_and_slots_at_least_one() -> None:
    with pytest.raises(ValueError, match="slot"):
        FairScheduler(0)
    with pytest.raises(ValueError, match="weight"):
        FairScheduler(1).add_job(1, weight=0)
