"""RunPlanner (server/runs/run_planner.py, with job_window.py): which batches of the jobs that
share a pipeline form its next run, with the real fair scheduler; the same path in a daemon is in
tests/integration/test_shared_pipelines.py."""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest

from dalid.protocol import InputBatch, OnError, SubmitBatch
from dalid.server.outputs.job_outputs import JobOutputs
from dalid.server.runs.run_planner import RunPlanner
from dalid.server.runs.runs import Member, PendingBatch
from dalid.server.runs.scheduler import FairScheduler, ServiceClock

BATCH = 4


def _member(job_id: int) -> Member:
    return Member(job_id, 1, JobOutputs([]), lambda batch, result: None, OnError.RAISE)


def _batch(member: Member, number: int, dtype: str = "uint8", image: bytes = b"") -> PendingBatch:
    samples = [np.frombuffer(image, np.uint8) if image else np.zeros(3, dtype)] * BATCH
    item = InputBatch.of("x", samples)
    return PendingBatch(number, SubmitBatch(1, (item,)), member)


class Planner:
    """A planner of a shared pipeline (runs of up to ``run_batches`` batches) over a one-slot
    scheduler, with members of ``weights`` by job id."""

    def __init__(self, weights: dict[int, float], run_batches: int = 4) -> None:
        self.scheduler = FairScheduler(1)
        self.members = {}
        self.planner = RunPlanner(self.scheduler, ServiceClock(), threading.Event(), 1000)
        self.planner.shared = True
        self.planner.run_size = run_batches * BATCH
        for job_id, weight in weights.items():
            self.scheduler.add_job(job_id, weight)
            self.members[job_id] = _member(job_id)
            self.planner.add(self.members[job_id])

    def submit(self, job_id: int, count: int, **batch: object) -> None:
        for number in range(count):
            self.planner.submit(_batch(self.members[job_id], number, **batch))  # type: ignore[arg-type]

    def run(self) -> list[int]:
        """The job of each batch of the next run (its slot given back at once)."""
        run = self.planner.next_run(collections.deque(), block=False)
        assert run is not None
        self.planner.give_slots(1)
        return [batch.member.job_id for batch in run.batches if batch.member]


def test_a_job_alone_gets_runs_that_are_its_batches() -> None:
    # As DALI's proxy runs them: operators whose result depends on a sample's place in its run
    # (the mixed decoder's hardware/CUDA split) then give what they give there.
    plan = Planner({1: 1.0})
    plan.submit(1, 6)
    assert [plan.run() for _ in range(6)] == [[1]] * 6


def test_busy_jobs_share_runs_one_batch_each() -> None:
    plan = Planner({1: 1.0, 2: 1.0, 3: 1.0})
    plan.submit(1, 6)
    plan.submit(2, 3)
    plan.submit(3, 1)
    runs = [sorted(plan.run()) for _ in range(6)]
    assert runs == [[1, 2, 3], [1, 2], [1, 2], [1], [1], [1]]


def test_weights_hold_across_mixed_runs() -> None:
    plan = Planner({1: 1.0, 3: 3.0}, run_batches=8)
    plan.submit(1, 200)
    plan.submit(3, 200)
    served = collections.Counter(job for _ in range(120) for job in plan.run())
    assert served[3] == pytest.approx(3 * served[1], rel=0.15), served


def test_a_quarantined_job_runs_alone_and_rides_with_no_one() -> None:
    plan = Planner({1: 1.0, 2: 1.0})
    plan.members[2].quarantine = 2
    plan.submit(2, 2)
    plan.submit(1, 2)
    runs = [plan.run() for _ in range(4)]
    assert runs.count([2]) == 2
    assert runs.count([1]) == 2


def test_batches_that_feed_other_dtypes_do_not_share_a_run() -> None:
    plan = Planner({1: 1.0, 2: 1.0})
    plan.submit(1, 1, dtype="uint8")
    plan.submit(2, 1, dtype="float32")
    assert sorted([plan.run(), plan.run()]) == [[1], [2]]


def test_an_image_over_the_pixel_limit_starts_a_run_of_its_own() -> None:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (64, 64)).save(out, format="PNG")  # 4096 pixels, over the limit of 1000
    plan = Planner({1: 1.0, 2: 1.0, 3: 1.0})
    plan.submit(1, 1)
    plan.submit(2, 1, image=out.getvalue())
    plan.submit(3, 1)
    first = plan.planner.next_run(collections.deque(), block=False)
    assert first is not None and [b.member.job_id for b in first.batches if b.member] == [1, 3]
    plan.planner.give_slots(1)
    second = plan.planner.next_run(collections.deque(), block=False)
    assert second is not None and len(second.batches) == 1 and second.batches[0].oversized


# --- Note [A job's window] ------------------------------------------------------------------

WINDOW = 2


class Windowed:
    """A pipeline of one job's own, with a window of ``WINDOW`` batches and no scheduler."""

    def __init__(self, copy_after: float | None = None) -> None:
        self.planner = RunPlanner(None, ServiceClock(), threading.Event(), 1000)
        self.planner.window = WINDOW
        # A run told the outputs' sizes (a job without output stores needs no room).
        self.planner.sample_sizes = [("cpu", 1)]
        self.member = _member(1)
        self.member.outputs.copy_after = copy_after
        self.planner.add(self.member)
        self.taken: dict[int, PendingBatch] = {}

    def submit(self, *numbers: int) -> None:
        for number in numbers:
            self.planner.submit(_batch(self.member, number))

    def take(self) -> int | None:
        """The batch id of the next run, or None when nothing may run now."""
        run = self.planner.next_run(collections.deque(), block=False)
        if run is None:
            return None
        (batch,) = run.batches
        self.taken[batch.batch_id] = batch
        return batch.batch_id


def test_a_full_window_holds_a_jobs_batches_back_until_one_is_settled() -> None:
    plan = Windowed()
    plan.submit(1, 2, 3, 4)
    assert [plan.take(), plan.take(), plan.take()] == [1, 2, None]
    assert plan.member.held == WINDOW
    plan.planner.settle(plan.taken[1], released=True)
    assert plan.take() == 3
    plan.planner.settle(plan.taken[1], released=True)  # settled once only
    assert plan.member.held == WINDOW
    assert plan.take() is None


def test_until_a_run_tells_the_outputs_sizes_the_window_holds_one_batch() -> None:
    # A window wider than the job's memory holds fills it; how wide that is is known
    # once a run's outputs are.
    plan = Windowed()
    plan.planner.sample_sizes = []
    plan.submit(1, 2, 3, 4)
    assert [plan.take(), plan.take()] == [1, None]
    plan.planner.want(plan.member, 4)
    assert plan.take() == 4  # the batch the trainer waits for passes it, as a full window
    plan.planner.sample_sizes = [("cpu", 1)]
    assert plan.take() is None  # the window (2) is full
    plan.planner.settle(plan.taken[1], released=True)
    assert plan.take() == 2


def test_the_wanted_batch_goes_first_and_passes_a_full_window() -> None:
    plan = Windowed()
    plan.submit(1, 2, 3, 4, 5, 6)
    assert [plan.take(), plan.take()] == [1, 2]  # arrived early: the trainer wants 6 first
    plan.planner.want(plan.member, 6)
    assert plan.take() == 6
    plan.planner.want(plan.member, 5)  # the trainer still holds 6 while it waits for 5
    assert plan.take() == 5
    plan.planner.want(plan.member, 4)
    assert plan.take() is None  # window + 2: it waits for a release (it takes no copies)
    plan.planner.settle(plan.taken[6], released=True)
    assert plan.take() == 4
    assert [b.batch_id for b in plan.member.queue] == [3]


def test_a_batch_wanted_before_it_arrives_goes_first_when_it_does() -> None:
    plan = Windowed()
    plan.submit(1, 2)
    assert [plan.take(), plan.take()] == [1, 2]
    plan.planner.want(plan.member, 9)
    plan.submit(7, 8, 9)
    assert [b.batch_id for b in plan.member.queue] == [9, 7, 8]
    assert plan.take() == 9


def test_wants_for_batches_the_job_does_not_have_queued_change_nothing() -> None:
    plan = Windowed()
    plan.submit(1, 2, 3)
    assert [plan.take(), plan.take()] == [1, 2]
    other = _member(2)  # another job's registration of another pipeline
    for batch_id in [*range(1000, 11000), 1, 2]:  # unknown, then delivered already
        plan.planner.want(plan.member, batch_id)
        plan.planner.want(other, batch_id)
    assert [b.batch_id for b in plan.member.queue] == [3]
    assert plan.member.held == WINDOW
    assert plan.take() is None  # the window still holds
    assert other.held == 0 and not other.queue and other.wanted is None


def test_a_trainer_that_keeps_its_outputs_overflows_the_window_until_it_releases() -> None:
    plan = Windowed(copy_after=0.0)
    plan.submit(*range(1, 9))
    assert [plan.take(), plan.take()] == [1, 2]
    for wanted in (3, 4):
        plan.planner.want(plan.member, wanted)
        assert plan.take() == wanted
    plan.planner.want(plan.member, 5)
    assert plan.take() == 5  # held window + 2 and waited copy_after: it overflows
    overflows = [plan.member.overflow]
    assert plan.take() == 6  # and its other batches pass too (its pool, then copies)
    plan.planner.settle(plan.taken[1], released=True)
    overflows.append(plan.member.overflow)
    assert overflows == [True, False]
    assert plan.take() is None


def test_a_job_whose_window_is_full_is_passed_over_on_a_shared_pipeline() -> None:
    plan = Planner({1: 1.0, 2: 1.0}, run_batches=1)
    plan.planner.window = WINDOW
    plan.planner.sample_sizes = [("cpu", 1)]
    plan.submit(1, 4)
    assert [plan.run(), plan.run()] == [[1], [1]]
    plan.submit(2, 2)
    # Job 1's trainer holds its window: job 2 runs on, and job 1 waits without a slot.
    assert [plan.run(), plan.run()] == [[2], [2]]
    assert plan.planner.next_run(collections.deque(), block=False) is None
    assert plan.members[1].held == WINDOW and len(plan.members[1].queue) == 2


def test_a_batch_submitted_between_the_look_and_the_wait_is_not_waited_for() -> None:
    # An idle executor looks for a batch, finds none, then waits on the planner's condition.
    # A submission that lands between the two notified no waiter: the executor must take it
    # at once, not after its idle wait (a second, every time the race is lost).
    planner = Planner({1: 1.0})
    look = planner.planner._pick
    waits: list[float | None] = []

    def look_then_submit(*args: object, **kwargs: object) -> PendingBatch | None:
        found = look(*args, **kwargs)  # type: ignore[arg-type]
        if found is None and not waits:
            planner.submit(1, 1)  # lands after the look, before the wait
        return found

    condition = planner.planner.changed
    wait = condition.wait

    def counted_wait(timeout: float | None = None) -> bool:
        waits.append(timeout)
        return wait(timeout)

    planner.planner._pick = look_then_submit  # type: ignore[method-assign]
    condition.wait = counted_wait  # type: ignore[method-assign]
    run = planner.planner.next_run(collections.deque(), block=True)
    assert run is not None and [batch.batch_id for batch in run.batches] == [0]
    assert waits == []


def test_forming_a_run_looks_at_the_jobs_in_turn_until_one_may_run_not_at_every_job() -> None:
    # Eight jobs share a pipeline: the scheduler's order is read once a run, and the looks at
    # a job's window and memory stop at the first job that may run (they were made for all
    # eight every run). The order they run in is the fair one, as before.
    plan = Planner(dict.fromkeys(range(1, 9), 1.0), run_batches=1)
    plan.planner.window = WINDOW
    plan.planner.sample_sizes = [("cpu", 1)]
    for job_id in range(1, 9):
        plan.submit(job_id, 2)
    looked: list[int] = []
    may_take = plan.planner._may_take

    def counted(member: Member, head: PendingBatch) -> bool:
        looked.append(member.job_id)
        return may_take(member, head)

    plan.planner._may_take = counted  # type: ignore[method-assign]
    runs = [plan.run() for _ in range(16)]
    assert sorted(job for run in runs for job in run) == sorted(list(range(1, 9)) * 2)
    assert [run[0] for run in runs[:8]] == list(range(1, 9))  # equal tags: the oldest first
    assert len(looked) == 16  # one look a run
    # Every window is full now: each job is looked at in its turn and passed over.
    for job_id in range(1, 9):
        plan.planner.submit(_batch(plan.members[job_id], 10))
    looked.clear()
    assert plan.planner.next_run(collections.deque(), block=False) is None
    assert sorted(looked) == list(range(1, 9))
    # A job whose window is full is passed over in its turn, and the next one in turn runs.
    plan.planner.settle(plan.members[2].holding[0], released=True)
    looked.clear()
    assert plan.run() == [2]
    assert looked == [1, 2]


def test_the_scheduler_reads_every_jobs_start_tag_at_one_moment() -> None:
    scheduler = FairScheduler(1)
    for job_id, weight in ((1, 1.0), (2, 2.0)):
        scheduler.add_job(job_id, weight)
    assert scheduler.start_tags([1, 2, 3]) == [
        scheduler.start_tag(1),
        scheduler.start_tag(2),
        None,
    ]
