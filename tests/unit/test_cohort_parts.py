"""A cohort's parts alone (docs/design/cohort-outputs.md): the split of a run's charge, the cache
of shared runs, members' leases and members' windows, each without a cohort, its lock or DALI.
The cohort that orders them is tested in test_cohorts.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dalid.protocol import InputBatch, OnError, OutputDescriptor, SubmitBatch
from dalid.server.outputs.job_outputs import JobOutputs
from dalid.server.runs.cohort_cache import CohortCache
from dalid.server.runs.cohort_charges import RunCharge
from dalid.server.runs.cohort_entries import Entry, EntryState
from dalid.server.runs.cohort_leases import COHORT_REGION_BASE, CohortLeases
from dalid.server.runs.cohort_windows import Admission, MemberWindows
from dalid.server.runs.runs import Member, PendingBatch


def _entry(digest: bytes = b"d", nbytes: int = 0, served: set[int] | None = None) -> Entry:
    entry = Entry(None, digest, (), (), None, served=set(served or ()))  # type: ignore[arg-type]
    if nbytes:
        descriptor = OutputDescriptor(7, "slab", 1 << 20, 0, nbytes, "uint8", (nbytes,))
        entry.state = EntryState.READY
        entry.descriptors = (descriptor, descriptor)
        entry.nbytes = nbytes
    return entry


# --- charges ------------------------------------------------------------------------------------


def test_a_runs_shares_always_add_up_to_its_time_and_each_job_pays_once() -> None:
    charge = RunCharge()
    assert charge.share(2) == []  # not charged yet: nothing to split
    paid: dict[int, float] = {}

    def add(charged: list[Any]) -> None:
        for job_id, seconds, _ in charged:
            paid[job_id] = paid.get(job_id, 0.0) + seconds

    add(charge.produced(1, 0.6))
    for job_id in (2, 3, 2):
        add(charge.share(job_id))
    assert charge.payers == [1, 2, 3]
    assert paid == pytest.approx({1: 0.2, 2: 0.2, 3: 0.2})
    assert sum(paid.values()) == pytest.approx(0.6)


def test_the_producer_pays_without_moving_its_tag_and_shares_move_tags() -> None:
    charge = RunCharge()
    ((_, _, produced),) = charge.produced(1, 0.5)
    assert not produced
    assert all(moves for _, _, moves in charge.share(2))


# --- the cache ----------------------------------------------------------------------------------


def test_outputs_held_for_trailing_members_only_stay_within_the_window_oldest_first() -> None:
    cache = CohortCache(JobOutputs([]), window_bytes=150)
    entries = [_entry(bytes([n]), nbytes=100, served={1}) for n in range(4)]
    entries[1].leases = 1  # a member holds it: it is not the window's to drop
    for entry in entries:
        cache.keep(entry)
    gone = cache.fit_window({1, 2})
    assert gone == [entries[0], entries[2]]
    assert cache.held_bytes() == 100 and cache.dropped == 2
    assert entries[0].state is EntryState.GONE and entries[1].cached and entries[3].cached


def test_an_entry_every_member_was_served_leaves_and_one_that_left_unserved_marks_them() -> None:
    cache = CohortCache(JobOutputs([]), window_bytes=1 << 30)
    served, unserved = _entry(b"a", nbytes=10, served={1, 2}), _entry(b"b", nbytes=10, served={1})
    for entry in (served, unserved):
        cache.add(entry)
        cache.keep(entry)
    assert cache.uncache_served({1, 2}) == [served]
    assert cache.matching(b"a") == [] and cache.matching(b"b") == [unserved]
    assert cache.evict_oldest({1, 2}) is unserved
    # Job 2 was not served it: its batch of the same inputs now is behind, once.
    assert cache.trails(b"b", 2) and not cache.trails(b"b", 2) and not cache.trails(b"b", 1)


def test_a_parked_entry_stays_until_the_batches_parked_on_it_are_served() -> None:
    cache = CohortCache(JobOutputs([]), window_bytes=1 << 30)
    entry = _entry(nbytes=10, served={1, 2})
    entry.parked = 1
    cache.keep(entry)
    assert cache.uncache_served({1, 2}) == []
    entry.parked = 0
    assert cache.uncache_served({1, 2}) == [entry]


# --- leases -------------------------------------------------------------------------------------


def test_each_member_leases_an_entry_under_ids_of_its_own_until_it_released_them_all() -> None:
    leases = CohortLeases(JobOutputs([]))
    entry = _entry(nbytes=10)
    mine = leases.lease(entry, 1, None, batch_id=5)
    theirs = leases.lease(entry, 2, None, batch_id=5)
    ids = [d.region_id for d in (*mine, *theirs)]
    assert len(set(ids)) == 4 and min(ids) >= COHORT_REGION_BASE
    assert entry.leases == 2 and leases.counted(1) == 1
    unknown, done = leases.release(1, [mine[0].region_id, theirs[0].region_id], "", ())
    assert unknown == [theirs[0].region_id] and done == []  # another's id is not its own
    unknown, done = leases.release(1, [mine[1].region_id], "", ())
    assert unknown == [] and len(done) == 1
    assert leases.end(done[0]) is None
    assert entry.leases == 1 and leases.counted(1) == 0


def test_a_producers_lease_counts_in_the_planners_window_and_settles_it() -> None:
    leases = CohortLeases(JobOutputs([]))
    settled: list[int] = []
    (descriptor, _) = leases.lease(_entry(nbytes=10), 1, lambda: settled.append(1), 3)
    assert leases.counted(1) == 0
    _, (done,) = leases.release(1, [descriptor.region_id, descriptor.region_id + 1], "", ())
    settle = leases.end(done)
    assert settle is not None
    settle()
    assert settled == [1]


def test_leases_of_a_gone_member_end_with_its_process_and_stop_counting_when_its_worker_left() -> (
    None
):
    leases = CohortLeases(JobOutputs([]))
    entry = _entry(nbytes=10)
    leases.lease(entry, 1, None, batch_id=5)
    leases.sender_left(1, 0, 10)
    assert leases.counted(1) == 0 and entry.leases == 1
    alive = {1234: True}
    assert leases.leave(1, 1234, 0, lambda pid, namespace: alive[pid]) == []
    assert leases.reap(lambda pid, namespace: alive[pid]) == []
    alive[1234] = False
    (ended,) = leases.reap(lambda pid, namespace: alive[pid])
    assert ended.settle is None and leases.end(ended) is None and entry.leases == 0


# --- members' windows ---------------------------------------------------------------------------


class _Executor:
    window = 2


def _member(job_id: int) -> Member:
    member = Member(job_id, 1, JobOutputs([]), lambda batch, result: None, OnError.RAISE)
    member.executor = _Executor()  # type: ignore[assignment]
    return member


def _batch(member: Member, batch_id: int) -> PendingBatch:
    item = InputBatch.of("x", [np.zeros(3, np.uint8)] * 2)
    return PendingBatch(batch_id, SubmitBatch(1, (item,)), member)


def test_a_full_window_parks_but_for_the_wanted_batch_which_passes_it_as_a_run_does() -> None:
    windows, member = MemberWindows(), _member(1)
    windows.join(1)
    assert windows.admit(member, 1, counted=1) is Admission.SERVE
    assert windows.admit(member, 1, counted=2) is Admission.PARK
    windows.want(1, 1)
    assert windows.admit(member, 1, counted=3) is Admission.SERVE
    assert windows.admit(member, 1, counted=4) is Admission.KEEPER  # it keeps its outputs


def test_parked_batches_count_on_their_entry_until_served_dropped_or_gone_with_it() -> None:
    windows, member = MemberWindows(), _member(1)
    windows.join(1)
    entry, other = _entry(b"a"), _entry(b"b")
    first, second, third = (_batch(member, n) for n in (1, 2, 3))
    windows.park(first, entry)
    windows.park(second, entry)
    windows.park(third, other)
    assert entry.parked == 2 and other.parked == 1
    oldest = windows.oldest(1)
    assert oldest is not None and oldest[1] is first
    assert windows.want(1, 2) == (second, entry) and entry.parked == 1
    assert windows.drop_parked_on(entry) == [first] and entry.parked == 0
    windows.sender_left(1, 3, 4)
    assert other.parked == 0 and windows.oldest(1) is None
