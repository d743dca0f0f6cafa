"""Waking executors after a receive turn (server/runs/wakes.py, Note [Waking executors after
the turn's answers]) on a real RunPlanner, its real Condition and a real waiting thread; that the
batches still flow through a daemon whose turns hold the wakes back is in
tests/integration/test_end_to_end.py, test_window.py, test_many_jobs.py and
test_shared_pipelines.py.

Whether a waiter was woken is read from the condition's waiters (a thread waiting on a
``threading.Condition`` is in its ``_waiters`` until a notify takes it out, which happens in the
notifying thread itself), so no test waits for something not to happen."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from dalid.protocol import InputBatch, OnError, SubmitBatch
from dalid.server.outputs.job_outputs import JobOutputs
from dalid.server.runs import wakes
from dalid.server.runs.run_planner import RunPlanner
from dalid.server.runs.runs import Member, PendingBatch
from dalid.server.runs.scheduler import ServiceClock

# Only a stuck test waits this long (a waiter that was never woken).
_STUCK_S = 30.0


def _batch(member: Member, batch_id: int) -> PendingBatch:
    item = InputBatch.of("x", [np.zeros(3, np.uint8)] * 2)
    return PendingBatch(batch_id, SubmitBatch(1, (item,)), member)


class Waiter:
    """A thread that waits on a planner's condition, as an idle executor does, and records in
    ``events`` when it was woken and the batches it found queued then."""

    def __init__(self, planner: RunPlanner, events: list[str]) -> None:
        self.planner = planner
        self.events = events
        self.waiting = threading.Event()
        self.thread = threading.Thread(target=self._wait, name="waiter")

    def _wait(self) -> None:
        with self.planner.changed:
            self.waiting.set()
            woken = self.planner.changed.wait(_STUCK_S)
            queued = [b.batch_id for m in self.planner.members for b in m.queue]
            self.events.append(f"woken={woken} queued={queued}")

    def start(self) -> None:
        self.thread.start()
        self.waiting.wait(_STUCK_S)
        # Once the flag is set the waiter sits in wait() (it set the flag holding the lock,
        # which wait() gives up only after adding the waiter): taking the lock orders us after.
        with self.planner.changed:
            assert self.waits()

    def waits(self) -> bool:
        """Whether the thread still waits un-notified (read under the condition's lock)."""
        return bool(self.planner.changed._waiters)  # type: ignore[attr-defined]

    def join(self) -> None:
        self.thread.join(_STUCK_S)
        assert not self.thread.is_alive()


@pytest.fixture
def planner() -> Iterator[tuple[RunPlanner, Member]]:
    planner = RunPlanner(None, ServiceClock(), threading.Event(), 1000)
    member = Member(1, 1, JobOutputs([]), lambda batch, result: None, OnError.RAISE)
    planner.add(member)
    yield planner, member
    planner.wake()  # no waiter is left behind by a failed test


def test_a_submission_in_a_turn_wakes_the_executor_only_when_the_turn_ends(
    planner: tuple[RunPlanner, Member],
) -> None:
    plan, member = planner
    events: list[str] = []
    waiter = Waiter(plan, events)
    waiter.start()
    with wakes.turn():
        plan.submit(_batch(member, 7))
        plan.submit(_batch(member, 8))
        # Queued at once: an executor busy with a run would take them now.
        assert [b.batch_id for b in member.queue] == [7, 8]
        with plan.changed:
            assert waiter.waits()  # but none is woken while the turn sends its answers
        events.append("turn ends")
    waiter.join()
    assert events == ["turn ends", "woken=True queued=[7, 8]"]


def test_outside_a_turn_a_submission_wakes_the_executor_at_once(
    planner: tuple[RunPlanner, Member],
) -> None:
    # The in-process link and any thread other than the daemon's I/O thread in its turn.
    plan, member = planner
    events: list[str] = []
    waiter = Waiter(plan, events)
    waiter.start()
    plan.submit(_batch(member, 3))
    with plan.changed:
        assert not waiter.waits()
    waiter.join()
    assert events == ["woken=True queued=[3]"]


def test_a_turn_wakes_as_many_waiters_as_its_notifies_would_have(
    planner: tuple[RunPlanner, Member],
) -> None:
    # Two instances of a pipeline wait; a turn that queued two batches wakes both.
    plan, member = planner
    events: list[str] = []
    waiters = [Waiter(plan, events) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    with wakes.turn():
        plan.submit(_batch(member, 1))
        plan.submit(_batch(member, 2))
    with plan.changed:
        assert len(plan.changed._waiters) == 1  # type: ignore[attr-defined]
    plan.wake()
    for waiter in waiters:
        waiter.join()
    assert sorted(events) == ["woken=True queued=[1, 2]"] * 3


def test_a_release_and_a_want_in_a_turn_wake_after_it(
    planner: tuple[RunPlanner, Member],
) -> None:
    # A release that lets the window move on, and a want that moves a batch to the front.
    plan, member = planner
    plan.window = 1
    plan.submit(_batch(member, 1))
    plan.submit(_batch(member, 2))
    run = plan.next_run(collections.deque(), block=False)
    assert run is not None
    plan.give_slots(1)
    (held,) = run.batches
    plan.submit(_batch(member, 3))
    events: list[str] = []
    waiter = Waiter(plan, events)
    waiter.start()
    with wakes.turn():
        plan.want(member, 3)
        plan.settle(held, released=True)
        assert [b.batch_id for b in member.queue] == [3, 2]
        with plan.changed:
            assert waiter.waits()
        events.append("turn ends")
    waiter.join()
    assert events == ["turn ends", "woken=True queued=[3, 2]"]


def test_a_turn_that_fails_still_wakes(planner: tuple[RunPlanner, Member]) -> None:
    plan, member = planner
    events: list[str] = []
    waiter = Waiter(plan, events)
    waiter.start()
    with pytest.raises(RuntimeError), wakes.turn():
        plan.submit(_batch(member, 5))
        raise RuntimeError("a handler failed")
    waiter.join()
    assert events == ["woken=True queued=[5]"]


def test_a_turn_inside_a_turn_leaves_the_wakes_to_the_outer_one(
    planner: tuple[RunPlanner, Member],
) -> None:
    plan, member = planner
    events: list[str] = []
    waiter = Waiter(plan, events)
    waiter.start()
    with wakes.turn():
        with wakes.turn():
            plan.submit(_batch(member, 4))
        with plan.changed:
            assert waiter.waits()
        events.append("turn ends")
    waiter.join()
    assert events == ["turn ends", "woken=True queued=[4]"]


def test_a_turn_is_its_own_threads(planner: tuple[RunPlanner, Member]) -> None:
    # An executor settling its own batch while the I/O thread is in a turn wakes at once.
    plan, member = planner
    events: list[str] = []
    waiter = Waiter(plan, events)
    waiter.start()
    with wakes.turn():
        other = threading.Thread(target=plan.submit, args=(_batch(member, 9),))
        other.start()
        other.join(_STUCK_S)
        with plan.changed:
            assert not waiter.waits()
        waiter.join()
        events.append("turn ends")
    assert events == ["woken=True queued=[9]", "turn ends"]
