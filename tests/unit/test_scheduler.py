"""FairScheduler: weighted shares, no saved-up credit, no queue jumping, cancellation; the
ServiceClock that prices batches in the daemon's time.

The real path (executors of several jobs in one daemon) is in tests/integration/test_many_jobs.py.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from dalid.server.runs.scheduler import BEHIND_SHARE, FairScheduler, ServiceClock


def never() -> bool:
    return False


def _serve_backlogged(
    scheduler: FairScheduler, costs: dict[int, int], grants: int
) -> dict[int, int]:
    """The cost each job gets served when all of them always have a batch waiting.

    One slot; each job's executor runs one batch at a time and, as a real one does, says at
    release that it has another ready. Returns the cost served per job over ``grants``.
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


def test_busy_jobs_share_the_cost_by_weight() -> None:
    scheduler = FairScheduler(1)
    scheduler.add_job(1, weight=1.0)
    scheduler.add_job(2, weight=3.0)
    served = _serve_backlogged(scheduler, {1: 8, 2: 8}, grants=400)
    assert served[2] / served[1] == pytest.approx(3.0, rel=0.1)


def test_shares_count_cost_not_batches() -> None:
    # A job whose batches cost four times as much gets a quarter as many of them.
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


# --- ServiceClock -------------------------------------------------------------------------------


def test_a_batch_costs_its_samples_times_the_last_measured_time_per_sample() -> None:
    clock = ServiceClock()
    assert clock.cost(8) == pytest.approx(8 * ServiceClock.INITIAL_SECONDS_PER_SAMPLE)
    assert clock.batch_done(8, entered=10.0, done=10.4) == pytest.approx(0.4)
    assert clock.cost(16) == pytest.approx(0.8)  # the first measurement replaces the guess


def test_overlapping_batches_are_each_charged_only_after_their_predecessor() -> None:
    clock = ServiceClock()
    # Two batches go in together (prefetch); the second comes out 0.1 s after the first.
    assert clock.batch_done(4, entered=0.0, done=0.5) == pytest.approx(0.5)
    assert clock.batch_done(4, entered=0.01, done=0.6) == pytest.approx(0.1)
    # After an idle gap, the next batch is charged from when it went in.
    assert clock.batch_done(4, entered=5.0, done=5.2) == pytest.approx(0.2)


def test_the_estimate_follows_a_pipeline_whose_samples_get_heavier() -> None:
    clock = ServiceClock()
    clock.batch_done(1, entered=0.0, done=0.01)
    now = 1.0
    for _ in range(40):
        clock.batch_done(1, entered=now, done=now + 0.05)
        now += 1.0
    assert clock.cost(1) == pytest.approx(0.05, rel=0.01)


def test_after_an_interruption_the_next_batch_is_charged_from_when_it_went_in() -> None:
    clock = ServiceClock()
    clock.batch_done(2, entered=0.0, done=1.0)
    clock.interrupted()
    assert clock.batch_done(2, entered=0.5, done=1.5) == pytest.approx(1.0)


def test_run_seconds_add_up_per_job() -> None:
    scheduler = FairScheduler(1)
    scheduler.add_job(1, weight=1.0)
    scheduler.charge(1, 0.25)
    scheduler.charge(1, 0.5)
    scheduler.charge(2, 9.0)  # an unknown job: nothing to count it to
    assert scheduler.stats(1).run_seconds == pytest.approx(0.75)
    assert scheduler.stats(2).run_seconds == 0.0


def test_batches_riding_in_a_shared_run_are_charged_to_their_jobs_alone() -> None:
    """A run of a shared pipeline holds one slot; its other batches ride along (ride): each
    moves its own job's tag, never the virtual time, so a backlogged job of another pipeline
    keeps the lead it has and is served next."""
    scheduler = FairScheduler(1)
    for job_id in (1, 2, 3):
        scheduler.add_job(job_id, 1.0)
    assert scheduler.acquire(1, 10, block=False, cancelled=never)  # a run: job 1's batch...
    for _ in range(3):
        scheduler.ride(2, 10)  # ... and three batches of job 2
    assert scheduler.start_tag(1) == 10
    assert scheduler.start_tag(2) == 30
    assert scheduler.start_tag(3) == 0  # untouched: job 3 comes first
    scheduler.release(1)
    assert scheduler.acquire(3, 10, block=False, cancelled=never)
    assert scheduler.stats(2).granted == 3
    scheduler.remove_job(2)
    assert scheduler.start_tag(2) is None


def test_a_run_shared_with_other_jobs_moves_each_ones_tag_by_its_share() -> None:
    # A cohort's run (server/runs/cohorts.py): job 1's slot paid for all of it, and jobs 2 and
    # 3 were served it too: each then weighs a third of it, job 1's tag moving back.
    scheduler = FairScheduler(1)
    for job_id in (1, 2, 3):
        scheduler.add_job(job_id, weight=1.0)
    assert scheduler.acquire(1, 0.9, block=False, cancelled=never)
    scheduler.release(1)
    for job_id in (2, 3):
        scheduler.share_run(job_id, 0.3)
    scheduler.share_run(1, -0.6)
    assert [scheduler.start_tag(job_id) for job_id in (1, 2, 3)] == pytest.approx([0.3] * 3)
    assert scheduler.stats(2).run_seconds == pytest.approx(0.3)
    # A tag moved back below the virtual time saves up no credit.
    scheduler.share_run(1, -5.0)
    assert scheduler.start_tag(1) == pytest.approx(0.0)


def _serve_in_tag_order(scheduler: FairScheduler, runs: int) -> list[int]:
    """Jobs 1 and 2 always have a batch of one sample ready; each run goes to the job whose
    start tag comes first (as a shared pipeline's planner picks: run_planner.py)."""
    order = []
    for _ in range(runs):
        tags = {job_id: scheduler.start_tag(job_id) for job_id in (1, 2)}
        job_id = min((1, 2), key=lambda j: (tags[j], j))
        assert scheduler.acquire(job_id, 1.0, block=False, cancelled=lambda: False)
        scheduler.release(job_id)
        order.append(job_id)
    return order


def test_a_cohort_member_behind_the_window_takes_what_the_others_leave_and_never_starves() -> None:
    scheduler = FairScheduler(slots=1)
    for job_id in (1, 2):
        scheduler.add_job(job_id, 1.0)
    scheduler.set_behind(2, True)
    assert scheduler.behind(2) and not scheduler.behind(1)
    order = _serve_in_tag_order(scheduler, 44)
    # One run of it per 1 / BEHIND_SHARE of the other's, and never none (its floor).
    assert order.count(2) == round(len(order) * BEHIND_SHARE / (1 + BEHIND_SHARE)), order
    assert all(part.count(2) >= 1 for part in (order[:12], order[11:23], order[22:34]))
    # Back within the window: its whole weight again, the two alternate.
    assert scheduler.acquire(2, 1.0, block=False, cancelled=never)  # one more run of it
    scheduler.release(2)
    scheduler.set_behind(2, False)
    # ... at once: it does not wait out the tags its runs took while behind.
    back, other = scheduler.start_tag(2), scheduler.start_tag(1)
    assert back is not None and other is not None and back <= other
    later = _serve_in_tag_order(scheduler, 30)[10:]
    assert later.count(1) == later.count(2) == 10, later
    # Its rank is not its charge: what its runs took is counted as ever.
    assert scheduler.weight(2) == 1.0
