"""A cohort's matching and leases (server/runs/cohorts.py): which batches match, who gets which
regions, when a region goes back to the cohort's pool, the window for trailing members, and
what a member's departure hands on.

Outputs are real DALI tensors written into a real shared-memory pool; the whole path, with real
jobs, is tests/integration/test_cohorts.py.
"""

from __future__ import annotations

import collections
import gc
import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from nvidia.dali.tensors import TensorListCPU

from dalid.protocol import BatchFailed, BatchReady, InputBatch, Limits, OnError, SubmitBatch
from dalid.server.errors import RequestRefused
from dalid.server.jobs.inputs import InputMemory
from dalid.server.outputs.job_outputs import JobOutputs
from dalid.server.outputs.pool import PAGE
from dalid.server.outputs.run_output import RunOutput
from dalid.server.outputs.shm import host_outputs
from dalid.server.runs.cohort_matching import batch_digest, same_inputs
from dalid.server.runs.cohort_registry import Cohorts
from dalid.server.runs.cohorts import COHORT_REGION_BASE, Cohort, Outcome
from dalid.server.runs.runs import Member, PendingBatch

LIMITS = Limits(
    max_batch_size=64, max_message_bytes=1 << 20, pool_bytes=64 * PAGE, slab_bytes=16 * PAGE
)
# One batch's outputs: 4 samples of one page each.
SAMPLES = 4
BATCH_BYTES = SAMPLES * PAGE


def _inputs(seed: int, corrupt: bool = False) -> tuple[InputBatch, ...]:
    samples = [np.full(7, seed * 10 + i, np.uint8) for i in range(SAMPLES)]
    if corrupt:
        samples[-1][-1] ^= 1
    return (InputBatch.of("data", samples),)


class _Executor:
    """Stands for a member's executor where a batch is handed on to run (the real one runs in
    the integration tests): records what it is given."""

    failed = False
    # The job's window (Note [A job's window] in job_window.py): 0, none.
    window = 0

    def __init__(self) -> None:
        self.submitted: list[PendingBatch] = []
        self.members: list[object] = [object()]  # the members it still runs for

    def submit(self, batch: PendingBatch) -> None:
        self.submitted.append(batch)


class _Job:
    def __init__(self, job_id: int) -> None:
        self.answers: list[tuple[PendingBatch, Any]] = []
        self.executor = _Executor()
        self.member = Member(
            job_id,
            1,
            JobOutputs([]),
            lambda batch, result: self.answers.append((batch, result)),
            OnError.RAISE,
        )
        self.member.executor = self.executor  # type: ignore[assignment]
        self._numbers = iter(range(1, 1000))

    def batch(self, seed: int, corrupt: bool = False) -> PendingBatch:
        number = next(self._numbers)
        request = SubmitBatch(1, _inputs(seed, corrupt), batch_id=number)
        return PendingBatch(number, request, self.member)


@pytest.fixture
def outputs() -> Iterator[JobOutputs]:
    made = host_outputs()(f"dalid-unittest-{os.getpid()}-{os.urandom(3).hex()}", LIMITS)
    made.copy_after = 0.0
    yield made
    made.close()
    made.free()


def _cohort(outputs: JobOutputs, window: int = 16 * PAGE, alive: bool = False) -> Cohort:
    return Cohort("sweep", ("key",), outputs, window, lambda pid, namespace: alive)


def _run(cohort: Cohort, batch: PendingBatch, value: float, settled: list[int]) -> list[Any]:
    """The run of ``batch``'s entry, published: the results it gives."""
    run = [RunOutput(0, TensorListCPU(np.full((SAMPLES, PAGE // 4), value, np.float32)))]
    descriptors = cohort.write(run, run[0].whole, None)
    assert descriptors is not None and batch.cohort_entry is not None
    # As the executor does: through the entry, whose cohort settles it.
    return batch.cohort_entry.publish(descriptors, lambda: settled.append(batch.batch_id))


def _ids(ready: BatchReady) -> list[int]:
    return [descriptor.region_id for descriptor in ready.outputs]


def test_the_same_inputs_match_byte_for_byte_and_anything_else_does_not() -> None:
    same, other = _inputs(1), _inputs(1)
    assert batch_digest(same) == batch_digest(other) and same_inputs(same, other)
    corrupt = _inputs(1, corrupt=True)
    assert batch_digest(corrupt) != batch_digest(same) and not same_inputs(same, corrupt)
    reordered = (InputBatch.of("data", [s.copy() for s in reversed(same[0].arrays())]),)
    assert not same_inputs(same, reordered)
    assert not same_inputs(same, other, (), (2,))  # a file the submitter could not read
    assert batch_digest(same, (2,)) != batch_digest(same)


def test_a_follower_gets_the_same_regions_under_ids_of_its_own(outputs: JobOutputs) -> None:
    cohort = _cohort(outputs)
    first, second = _Job(1), _Job(2)
    cohort.join(first.member)
    cohort.join(second.member)
    running, following = first.batch(0), second.batch(0)
    assert cohort.take(running) == (Outcome.RUN, None)
    assert cohort.take(following) == (Outcome.FOLLOW, None)
    settled: list[int] = []
    results = _run(cohort, running, 3.0, settled)
    assert [batch for batch, _ in results] == [running, following]
    (mine,), (theirs,) = (ready.outputs for _, ready in results)
    assert (mine.slab, mine.offset) == (theirs.slab, theirs.offset)
    assert mine.region_id != theirs.region_id and min(mine.region_id, theirs.region_id) >= (
        COHORT_REGION_BASE
    )
    assert outputs.leased_regions == 1
    # A member releases only its own ids; the region goes back once both have.
    assert cohort.release(1, [theirs.region_id]) == [theirs.region_id]
    assert cohort.release(1, [mine.region_id]) == [] and settled == [running.batch_id]
    assert outputs.leased_regions == 1
    assert cohort.release(2, [theirs.region_id]) == []
    assert outputs.leased_regions == 0
    status = cohort.status()
    assert (status.runs, status.hits, status.hit_rate, status.lag_batches) == (1, 1, 0.5, 0)


def test_a_late_member_is_served_from_the_cache_and_never_its_own_outputs_again(
    outputs: JobOutputs,
) -> None:
    cohort = _cohort(outputs)
    first, second = _Job(1), _Job(2)
    cohort.join(first.member)
    cohort.join(second.member)
    running = first.batch(0)
    cohort.take(running)
    ((_, ready),) = _run(cohort, running, 1.0, [])
    assert cohort.status().held_bytes == 0  # leased by the first member, not only held
    cohort.release(1, _ids(ready))
    assert cohort.status().held_bytes == BATCH_BYTES and cohort.status().lag_batches == 1
    outcome, hit = cohort.take(second.batch(0))
    assert outcome == Outcome.HIT and hit is not None
    assert hit.outputs[0].slab == ready.outputs[0].slab
    # Served to every member: out of the cache. The first member's next epoch runs again.
    assert cohort.status().held_bytes == 0
    again = first.batch(0)
    assert cohort.take(again) == (Outcome.RUN, None) and again.cohort_entry is not None
    cohort.release(2, _ids(hit))
    assert outputs.leased_regions == 0


def test_outputs_held_for_a_trailing_member_stay_within_the_window(outputs: JobOutputs) -> None:
    window = 2 * BATCH_BYTES
    cohort = _cohort(outputs, window=window)
    leader, trailing = _Job(1), _Job(2)
    cohort.join(leader.member)
    cohort.join(trailing.member)
    for seed in range(5):
        batch = leader.batch(seed)
        cohort.take(batch)
        ((_, ready),) = _run(cohort, batch, float(seed), [])
        cohort.release(1, _ids(ready))
        assert cohort.status().held_bytes <= window
    status = cohort.status()
    assert status.dropped == 3 and status.lag_batches == 5
    # The oldest went: the trailing member runs those itself, and is served the newest.
    assert cohort.take(trailing.batch(0))[0] == Outcome.RUN
    assert cohort.take(trailing.batch(4))[0] == Outcome.HIT


def test_a_full_pool_drops_held_outputs_first_then_gives_up(outputs: JobOutputs) -> None:
    cohort = _cohort(outputs, window=LIMITS.pool_bytes)
    leader, trailing = _Job(1), _Job(2)
    cohort.join(leader.member)
    cohort.join(trailing.member)
    held = LIMITS.pool_bytes // BATCH_BYTES
    for seed in range(held + 2):
        batch = leader.batch(seed)
        cohort.take(batch)
        ((_, ready),) = _run(cohort, batch, 1.0, [])
        cohort.release(1, _ids(ready))
    assert cohort.status().dropped >= 2
    # Leased outputs cannot be dropped: with every byte leased, a run is not taken.
    for seed in range(held):
        cohort.take(trailing.batch(seed + 2))
    batch = leader.batch(20)
    cohort.take(batch)
    run = [RunOutput(0, TensorListCPU(np.zeros((SAMPLES, PAGE // 4), np.float32)))]
    assert cohort.write(run, run[0].whole, None) is None


def test_a_failed_run_hands_its_followers_back_to_run_for_themselves(outputs: JobOutputs) -> None:
    cohort = _cohort(outputs)
    first, second = _Job(1), _Job(2)
    cohort.join(first.member)
    cohort.join(second.member)
    running, following = first.batch(0), second.batch(0)
    cohort.take(running)
    cohort.take(following)
    assert running.cohort_entry is not None
    assert running.cohort_entry.abandon() == [following]
    assert following.cohort_entry is None
    # Nothing is left to match: the same inputs run anew.
    assert cohort.take(second.batch(0))[0] == Outcome.RUN


def test_a_member_leaving_hands_its_queued_run_to_a_follower(outputs: JobOutputs) -> None:
    cohort = _cohort(outputs)
    first, second = _Job(1), _Job(2)
    cohort.join(first.member)
    cohort.join(second.member)
    queued, following = first.batch(0), second.batch(0)
    cohort.take(queued)
    cohort.take(following)
    first.member.closed = True
    cohort.leave(first.member, pid=0, namespace=0)
    assert second.executor.submitted == [following]
    assert following.cohort_entry is queued.cohort_entry
    assert cohort.status().jobs == (2,)


def test_a_run_taken_by_a_pipeline_that_stopped_with_its_job_passes_to_a_follower(
    outputs: JobOutputs,
) -> None:
    cohort = _cohort(outputs)
    first, second = _Job(1), _Job(2)
    cohort.join(first.member)
    cohort.join(second.member)
    running, following = first.batch(0), second.batch(0)
    cohort.take(running)
    cohort.take(following)
    running.held = True  # taken into a run
    first.member.closed = True
    first.executor.members = []  # its pipeline was its own: it stopped with it
    cohort.leave(first.member, pid=0, namespace=0)
    assert second.executor.submitted == [following]


def test_a_gone_members_leases_end_with_its_process(outputs: JobOutputs) -> None:
    alive = [True]
    cohort = Cohort("sweep", ("key",), outputs, 16 * PAGE, lambda pid, ns: alive[0])
    first, second = _Job(1), _Job(2)
    cohort.join(first.member)
    cohort.join(second.member)
    running = first.batch(0)
    cohort.take(running)
    ((_, ready),) = _run(cohort, running, 1.0, [])
    cohort.take(second.batch(0))
    cohort.release(2, [])
    first.member.closed = True
    cohort.leave(first.member, pid=12345, namespace=1)
    cohort.reap()
    assert outputs.leased_regions == 1  # its trainer may still view the region
    alive[0] = False
    cohort.reap()
    assert cohort.release(1, _ids(ready)) == _ids(ready)  # ended already
    assert outputs.leased_regions == 1  # the second member still holds it


def test_a_member_whose_pipeline_failed_gets_its_batch_failed(outputs: JobOutputs) -> None:
    cohort = _cohort(outputs)
    first, second = _Job(1), _Job(2)
    cohort.join(first.member)
    cohort.join(second.member)
    queued, following = first.batch(0), second.batch(0)
    cohort.take(queued)
    cohort.take(following)
    second.executor.failed = True
    cohort.leave(first.member, pid=0, namespace=0)
    ((batch, result),) = second.answers
    assert batch is following and isinstance(result, BatchFailed)


def test_a_registration_of_another_graph_or_deterministic_is_refused() -> None:
    cohorts = Cohorts(lambda prefix, limits: JobOutputs([]), 0, lambda pid, ns: True)
    member = _Job(1).member
    cohorts.join("sweep", ("serialized", b"graph", ("data",), 1, 8), member, LIMITS, "dalid-x")
    with pytest.raises(RequestRefused, match=r"cohort 'sweep' .*graph differ"):
        cohorts.check("sweep", ("serialized", b"other", ("data",), 1, 8), deterministic=False)
    with pytest.raises(RequestRefused, match=r"batch size differ"):
        cohorts.check("sweep", ("serialized", b"graph", ("data",), 1, 16), deterministic=False)
    with pytest.raises(RequestRefused, match="deterministic"):
        cohorts.check("sweep", ("serialized", b"graph", ("data",), 1, 8), deterministic=True)
    cohorts.check("sweep", ("serialized", b"graph", ("data",), 1, 8), deterministic=False)
    cohorts.check("another", ("serialized", b"other", ("data",), 1, 8), deterministic=False)
    with pytest.raises(RequestRefused, match="member already"):
        cohorts.check("sweep", ("serialized", b"graph", ("data",), 1, 8), False, member.job_id)
    cohorts.leave(member, pid=0, namespace=0)
    assert cohorts.status() == ()


def _served_by(cohort: Cohort, leader: _Job, seeds: range) -> list[BatchReady]:
    """The leader's runs of ``seeds``, released at once: each waits in the cache."""
    readies = []
    for seed in seeds:
        batch = leader.batch(seed)
        cohort.take(batch)
        ((_, ready),) = _run(cohort, batch, float(seed), [])
        cohort.release(leader.member.job_id, _ids(ready))
        readies.append(ready)
    return readies


def test_hits_count_in_the_members_window_and_wait_for_its_releases(outputs: JobOutputs) -> None:
    cohort = _cohort(outputs, window=LIMITS.pool_bytes)
    leader, member = _Job(1), _Job(2)
    member.executor.window = 2
    cohort.join(leader.member)
    cohort.join(member.member)
    _served_by(cohort, leader, range(6))
    batches = [member.batch(seed) for seed in range(6)]
    first, second = (cohort.take(batch) for batch in batches[:2])
    assert first[0] == second[0] == Outcome.HIT
    # Its window is full: the next wait, answered as its trainer releases a batch.
    assert cohort.take(batches[2]) == (Outcome.PARKED, None)
    assert cohort.take(batches[3]) == (Outcome.PARKED, None)
    assert not member.answers and cohort.status().held_bytes >= 2 * BATCH_BYTES
    assert first[1] is not None
    cohort.release(2, _ids(first[1]))
    ((answered, ready),) = member.answers
    assert answered is batches[2] and isinstance(ready, BatchReady)
    assert ready.outputs[0].slab  # the leader's run, from the cohort's memory
    # The batch its trainer waits for passes the full window (by TRAINER_HOLDS + 1)...
    for batch in batches[3:5]:
        if batch is batches[4]:
            assert cohort.take(batch) == (Outcome.PARKED, None)
        cohort.want(2, batch.batch_id)
        assert member.answers[-1][0] is batch
    # ...and past that a trainer that keeps its outputs has its batch run for it alone, where
    # the run path's window and private copies bound it.
    assert cohort.take(batches[5]) == (Outcome.PARKED, None)
    cohort.want(2, batches[5].batch_id)
    assert member.executor.submitted == [batches[5]] and batches[5].cohort_entry is None
    assert len(member.answers) == 3


def test_a_follower_past_its_window_waits_and_a_dropped_entry_runs_it_alone(
    outputs: JobOutputs,
) -> None:
    cohort = _cohort(outputs, window=BATCH_BYTES)
    leader, member = _Job(1), _Job(2)
    member.executor.window = 1
    cohort.join(leader.member)
    cohort.join(member.member)
    _served_by(cohort, leader, range(1))
    assert cohort.take(member.batch(0))[0] == Outcome.HIT
    running, following = leader.batch(1), member.batch(1)
    cohort.take(running)
    assert cohort.take(following) == (Outcome.FOLLOW, None)
    results = _run(cohort, running, 1.0, [])
    assert [batch for batch, _ in results] == [running]  # the follower waits for room
    cohort.release(1, _ids(results[0][1]))
    # The outputs it waits on are dropped to keep the window of held bytes: it runs alone.
    _served_by(cohort, leader, range(2, 4))
    assert member.executor.submitted == [following] and cohort.status().dropped >= 1
    # It was served one batch (the first) of the leader's four runs.
    assert (cohort.status().runs, cohort.status().hits) == (4, 1)


def test_a_keeper_past_its_window_gets_copies_of_the_cached_outputs_not_a_second_run(
    outputs: JobOutputs,
) -> None:
    cohort = _cohort(outputs, window=LIMITS.pool_bytes)
    leader, keeper = _Job(1), _Job(2)
    keeper.executor.window = 2
    keeper.member.outputs.copy_after = 0.0  # its trainer takes private copies
    cohort.join(leader.member)
    cohort.join(keeper.member)
    _served_by(cohort, leader, range(5))
    batches = [keeper.batch(seed) for seed in range(6)]
    # It keeps every batch: two fill its window, two more pass it as the batch it waits for.
    for batch in batches[:4]:
        outcome, ready = cohort.take(batch)
        if outcome == Outcome.PARKED:
            cohort.want(2, batch.batch_id)
            ((_, ready),) = keeper.answers[-1:]
        assert isinstance(ready, BatchReady) and ready.outputs[0].slab and not ready.copies
    leased = cohort.status().leased_bytes
    # Past that, the batch it waits for comes as a copy of the cached run, not run again.
    assert cohort.take(batches[4]) == (Outcome.PARKED, None)
    cohort.want(2, batches[4].batch_id)
    # And a batch that follows a run, as that run's copy once it is published.
    cohort.want(2, batches[5].batch_id)
    running = leader.batch(5)
    cohort.take(running)
    assert cohort.take(batches[5]) == (Outcome.FOLLOW, None)
    assert [batch for batch, _ in _run(cohort, running, 5.0, [])] == [running]
    assert not keeper.executor.submitted
    for (batch, ready), seed in zip(keeper.answers[-2:], (4, 5), strict=True):
        assert batch is batches[seed] and isinstance(ready, BatchReady)
        (descriptor,) = ready.outputs
        assert (descriptor.slab, descriptor.region_id) == ("", 0)  # leases nothing
        assert descriptor.shape == (SAMPLES, PAGE // 4)
        (copy,) = ready.copies
        assert (np.frombuffer(copy, np.float32) == float(seed)).all()
    status = cohort.status()
    assert (status.runs, status.hits) == (6, 6)
    # The copies lease nothing of the cohort's memory beyond the keeper's window (and the
    # leader's last run, not released yet).
    assert status.leased_bytes == leased + BATCH_BYTES


def test_a_worker_that_left_takes_its_batches_out_of_the_members_window(
    outputs: JobOutputs,
) -> None:
    cohort = _cohort(outputs, window=LIMITS.pool_bytes)
    leader, member = _Job(1), _Job(2)
    member.executor.window = 1
    cohort.join(leader.member)
    cohort.join(member.member)
    _served_by(cohort, leader, range(3))
    early, parked, later = (member.batch(seed) for seed in range(3))
    assert cohort.take(early)[0] == Outcome.HIT
    assert cohort.take(parked) == (Outcome.PARKED, None)
    # The worker of ``early`` and ``parked`` left: neither counts, nor is answered.
    cohort.sender_left(2, early.batch_id, parked.batch_id + 1)
    assert not member.answers
    assert cohort.take(later)[0] == Outcome.HIT


def test_a_run_is_charged_once_split_among_the_members_that_consumed_it(
    outputs: JobOutputs,
) -> None:
    charges: list[tuple[int, float]] = []  # to run_seconds only: the producer's slot's tag
    shares: list[tuple[int, float]] = []  # to run_seconds and the fair-share tag
    cohort = Cohort(
        "sweep",
        ("key",),
        outputs,
        16 * PAGE,
        lambda pid, ns: False,
        charge=lambda job_id, seconds: charges.append((job_id, seconds)),
        share=lambda job_id, seconds: shares.append((job_id, seconds)),
    )
    jobs = [_Job(job_id) for job_id in (1, 2, 3)]
    for job in jobs:
        cohort.join(job.member)
    running, following = jobs[0].batch(0), jobs[1].batch(0)
    cohort.take(running)
    cohort.take(following)
    assert running.cohort_entry is not None
    running.cohort_entry.account(0.3)
    _run(cohort, running, 1.0, [])

    def totals(*lists: list[tuple[int, float]]) -> dict[int, float]:
        summed = {job.member.job_id: 0.0 for job in jobs}
        for job_id, seconds in itertools.chain(*lists):
            summed[job_id] += seconds
        return summed

    assert totals(charges, shares) == pytest.approx({1: 0.15, 2: 0.15, 3: 0.0})
    # The producer's slot paid the whole run's tag: what the follower takes on comes back.
    assert totals(shares) == pytest.approx({1: -0.15, 2: 0.15, 3: 0.0})
    # A member served it from the cache later takes its share from the others'.
    assert cohort.take(jobs[2].batch(0))[0] == Outcome.HIT
    assert totals(charges, shares) == pytest.approx({1: 0.1, 2: 0.1, 3: 0.1})
    assert sum(totals(charges, shares).values()) == pytest.approx(0.3)


def test_a_follower_never_given_the_outputs_takes_no_share_of_the_run(
    outputs: JobOutputs,
) -> None:
    paid: collections.defaultdict[int, float] = collections.defaultdict(float)

    def pay(job_id: int, seconds: float) -> None:
        paid[job_id] += seconds

    cohort = Cohort(
        "sweep", ("key",), outputs, BATCH_BYTES, lambda pid, ns: False, charge=pay, share=pay
    )
    leader, keeper, failing = _Job(1), _Job(2), _Job(3)
    keeper.executor.window = 1
    for job in (leader, keeper, failing):
        cohort.join(job.member)
    _served_by(cohort, leader, range(1))
    assert cohort.take(keeper.batch(0))[0] == Outcome.HIT  # fills the keeper's window
    paid.clear()
    # The keeper follows the leader's run, waits past its window, and runs alone once the
    # outputs it waited on are dropped: it pays for that run of its own, not for the shared one.
    running, following = leader.batch(1), keeper.batch(1)
    cohort.take(running)
    assert cohort.take(following) == (Outcome.FOLLOW, None)
    assert running.cohort_entry is not None
    running.cohort_entry.account(0.3)
    ((_, ready),) = _run(cohort, running, 1.0, [])
    cohort.release(1, _ids(ready))
    _served_by(cohort, leader, range(2, 4))
    assert keeper.executor.submitted == [following]
    assert paid[1] == pytest.approx(0.3) and paid[2] == pytest.approx(0.0)
    # A run that fails shares nothing: its followers run for themselves and pay for that.
    paid.clear()
    running, following = leader.batch(4), failing.batch(4)
    cohort.take(running)
    assert cohort.take(following) == (Outcome.FOLLOW, None)
    entry = running.cohort_entry
    assert entry is not None
    entry.account(0.2)
    assert entry.abandon() == [following]
    assert paid == {1: pytest.approx(0.2)}


def test_inputs_kept_for_matching_are_counted_until_the_entry_lets_go_of_them(
    outputs: JobOutputs,
) -> None:
    inputs = InputMemory(1 << 20)
    cohort = _cohort(outputs)
    first, second = _Job(1), _Job(2)
    cohort.join(first.member)
    cohort.join(second.member)
    running = first.batch(0)
    nbytes = sum(item.nbytes for item in running.request.inputs)
    inputs.take(1, nbytes, holder=running)
    cohort.take(running)
    ((produced, ready),) = _run(cohort, running, 1.0, [])
    cohort.release(1, _ids(ready))
    gc.disable()  # the count must follow the memory by itself, not wait for a collection
    try:
        del running, produced, ready
        assert inputs.held == nbytes  # kept, for the second member to match
        assert cohort.take(second.batch(0))[0] == Outcome.HIT
        # Served to every member: nothing can match it any more, and its inputs go.
        assert inputs.held == 0
    finally:
        gc.enable()


def _ranked_pair(outputs: JobOutputs) -> tuple[Cohort, list[tuple[int, bool]], _Job, _Job]:
    """A cohort of two members (jobs 1 and 2) whose window holds two batches, and the list of
    (job, behind) its rank changes append to."""
    ranks: list[tuple[int, bool]] = []
    cohort = Cohort(
        "sweep",
        ("key",),
        outputs,
        2 * BATCH_BYTES,
        lambda pid, namespace: False,
        behind=lambda job_id, behind: ranks.append((job_id, behind)),
    )
    first, second = _Job(1), _Job(2)
    cohort.join(first.member)
    cohort.join(second.member)
    return cohort, ranks, first, second


def test_a_member_past_the_window_ranks_behind_until_it_matches_again(outputs: JobOutputs) -> None:
    cohort, ranks, leader, trailing = _ranked_pair(outputs)
    for seed in range(5):
        batch = leader.batch(seed)
        assert cohort.take(batch)[0] == Outcome.RUN
        ((_, ready),) = _run(cohort, batch, float(seed), [])
        cohort.release(1, _ids(ready))
    # The leader's batches of seeds 0-2 left the cache before the trailing member had them.
    assert cohort.status().dropped == 3 and not ranks
    # Its batch of those inputs runs for it alone, ranked behind; still one entry of its own.
    assert cohort.take(trailing.batch(0))[0] == Outcome.RUN
    assert ranks == [(2, True)]
    status = cohort.status()
    assert status.behind == (2,) and status.behind_runs == 1
    # A second such batch changes nothing more; the leader's new inputs do not rank it.
    assert cohort.take(trailing.batch(1))[0] == Outcome.RUN
    assert cohort.take(leader.batch(9))[0] == Outcome.RUN
    assert ranks == [(2, True)] and cohort.status().behind_runs == 2
    # Caught up: its batch matches an entry in the cache again, and it regains its rank.
    assert cohort.take(trailing.batch(4))[0] == Outcome.HIT
    assert ranks == [(2, True), (2, False)] and cohort.status().behind == ()


def test_a_member_that_leads_or_was_served_everything_is_never_behind(outputs: JobOutputs) -> None:
    cohort, ranks, first, second = _ranked_pair(outputs)
    for seed in range(5):
        batch = first.batch(seed)
        cohort.take(batch)
        ((_, ready),) = _run(cohort, batch, float(seed), [])
        cohort.release(1, _ids(ready))
        # In step: the second member is served each before it leaves the cache.
        outcome, hit = cohort.take(second.batch(seed))
        assert outcome == Outcome.HIT and hit is not None
        cohort.release(2, _ids(hit))
    # Inputs no member ran: it leads, at its normal rank.
    assert cohort.take(second.batch(7))[0] == Outcome.RUN
    assert not ranks and cohort.status().dropped == 0
