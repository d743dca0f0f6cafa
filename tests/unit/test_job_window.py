"""A job's window alone (server/runs/job_window.py, Note [A job's window]): which of a member's
batches may be taken into a run, without a planner, a scheduler or DALI. The same rules through
the planner are in test_runs.py, through a daemon in tests/integration/test_window.py."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from dalid.protocol import BATCH_IDS_PER_CONNECTION, InputBatch, Limits, OnError, SubmitBatch
from dalid.server.outputs.job_outputs import JobOutputs
from dalid.server.outputs.shm import host_outputs
from dalid.server.runs.job_window import TRAINER_HOLDS, JobWindow, Take
from dalid.server.runs.runs import Member, PendingBatch

WINDOW = 3
PAGE = 4096


def _member(outputs: JobOutputs | None = None) -> Member:
    return Member(1, 1, outputs or JobOutputs([]), lambda batch, result: None, OnError.RAISE)


def _batch(member: Member, batch_id: int) -> PendingBatch:
    item = InputBatch.of("x", [np.zeros(3, np.uint8)] * 4)
    return PendingBatch(batch_id, SubmitBatch(1, (item,)), member)


def _overflows(member: Member) -> bool:
    return member.overflow


def _window() -> JobWindow:
    window = JobWindow()
    window.window = WINDOW
    window.sample_sizes = [("cpu", 1)]  # a job without output stores needs no room
    return window


def _held(window: JobWindow, member: Member, count: int) -> list[PendingBatch]:
    batches = [_batch(member, batch_id) for batch_id in range(1, count + 1)]
    for batch in batches:
        assert window.check(member, batch) is Take.YES
        window.hold(batch)
    return batches


def test_a_full_window_takes_no_batch_but_the_wanted_one_up_to_what_the_trainer_holds() -> None:
    window, member = _window(), _member()
    _held(window, member, WINDOW)
    assert member.held == WINDOW
    assert window.check(member, _batch(member, 10)) is Take.NO
    window.want(member, 11)
    wanted = _batch(member, 11)
    assert window.check(member, wanted) is Take.YES
    # The wanted batch passes the full window by TRAINER_HOLDS + 1, and no further.
    for batch_id in range(20, 20 + TRAINER_HOLDS + 1):
        window.hold(_batch(member, batch_id))
    assert window.check(member, wanted) is Take.NO  # its trainer takes no copies: it waits


def test_a_batch_leaves_the_window_once_and_a_release_ends_the_overflow() -> None:
    window, member = _window(), _member()
    first, *_ = _held(window, member, WINDOW)
    member.overflow = True
    assert window.settle(first, released=False)
    assert not window.settle(first, released=True)  # settled once only
    assert member.held == WINDOW - 1 and member.overflow
    second = member.holding[2]
    assert window.settle(second, released=True)
    assert not member.overflow


def test_a_trainer_that_keeps_its_outputs_overflows_once_its_wanted_batch_waited() -> None:
    window, member = _window(), _member()
    member.outputs.copy_after = 60.0
    _held(window, member, WINDOW)
    for batch_id in range(20, 20 + TRAINER_HOLDS + 1):  # what the wanted batches passed by
        window.hold(_batch(member, batch_id))
    window.want(member, 50)
    wanted = _batch(member, 50)
    assert window.check(member, wanted) is Take.NOT_YET  # look again soon
    assert member.want_blocked_since is not None and not _overflows(member)
    member.want_blocked_since -= 60.0
    assert window.check(member, wanted) is Take.YES and _overflows(member)
    # Overflowing, every batch passes the window until the trainer releases one.
    assert window.check(member, _batch(member, 51)) is Take.YES


def test_taking_the_wanted_batch_clears_the_want() -> None:
    window, member = _window(), _member()
    window.want(member, 7)
    window.hold(_batch(member, 7))
    assert member.wanted is None and member.held == 1


def test_a_worker_that_left_takes_its_batches_out_and_its_later_ones_never_count() -> None:
    window, member = _window(), _member()
    base = 3 * BATCH_IDS_PER_CONNECTION
    gone = [_batch(member, base + n) for n in range(2)]
    stays = _batch(member, 5)
    for batch in [*gone, stays]:
        window.hold(batch)
    assert window.sender_left(member, base, base + BATCH_IDS_PER_CONNECTION)
    assert member.held == 1 and not any(batch.held for batch in gone) and stays.held
    late = _batch(member, base + 5)  # ran after its worker left: nobody asks for it
    window.hold(late)
    assert not late.held and member.held == 1
    assert not window.sender_left(member, base, base + BATCH_IDS_PER_CONNECTION)


LIMITS = Limits(
    max_batch_size=64, max_message_bytes=1 << 20, pool_bytes=8 * PAGE, slab_bytes=4 * PAGE
)


@pytest.fixture
def outputs() -> Iterator[JobOutputs]:
    made = host_outputs()(f"dalid-unittest-{os.getpid()}-{os.urandom(3).hex()}", LIMITS)
    yield made
    made.close()
    made.free()


def test_a_window_is_one_batch_until_sizes_are_known_then_no_wider_than_the_memory(
    outputs: JobOutputs,
) -> None:
    window, member = JobWindow(), _member(outputs)
    window.window = 16
    head = _batch(member, 1)
    assert window.width(member, head) == 1  # no run has told the outputs' sizes yet
    window.sample_sizes = [("cpu", PAGE // 4)]  # a batch of 4 samples: one page
    fits = outputs.batches_fit(window.sizes(head))
    assert 2 < fits < 16
    # Beside the batch the trainer holds and the one it waits for.
    assert window.width(member, head) == fits - TRAINER_HOLDS - 1
