"""The fair scheduler's slots a pipeline's DALI instance holds for its runs in flight, and the
one it keeps for its next run. Each instance forms and runs its runs in a thread of its own,
so what it holds is its thread's: one instance never gives back or waits on another's."""

from __future__ import annotations

import threading

from .scheduler import FairScheduler, ServiceClock


class _Held(threading.local):
    """What the calling thread's instance holds of the scheduler."""

    def __init__(self) -> None:
        self.slots: list[int] = []  # the job each held slot was taken for, oldest first
        # The job a slot is kept for (``release(next_cost=...)``), whose batch starts the next
        # run.
        self.kept_for: int | None = None


class Slots:
    """A pipeline's slots of ``scheduler``, per instance thread; ``clock`` costs a run of a
    given number of samples; ``stopping`` cancels a wait for a slot. Without a scheduler,
    every slot is free."""

    def __init__(
        self, scheduler: FairScheduler | None, clock: ServiceClock, stopping: threading.Event
    ) -> None:
        self._scheduler = scheduler
        self._clock = clock
        self._stopping = stopping
        self._held = _Held()

    @property
    def held(self) -> int:
        """How many slots the calling thread's instance holds."""
        return len(self._held.slots)

    @property
    def kept_for(self) -> int | None:
        """The job whose batch the calling instance's next run starts with, if one is kept."""
        return self._held.kept_for

    def take(self, job_id: int, samples: int, block: bool) -> bool:
        """Takes a slot for a run of ``job_id`` of ``samples`` samples; whether it did."""
        scheduler = self._scheduler
        if scheduler is None:
            return True
        held = self._held
        if held.kept_for is not None and held.kept_for != job_id:
            # The slot kept for another job of this pipeline goes back, or this executor could
            # wait for a slot that only it could take.
            scheduler.forfeit(held.kept_for)
        held.kept_for = None
        cost = self._clock.cost(samples)
        if not scheduler.acquire(job_id, cost, block=block, cancelled=self._stopping.is_set):
            return False
        held.slots.append(job_id)
        return True

    def give(self, count: int, next_job: int | None = None, next_samples: int = 0) -> None:
        """Gives back the oldest ``count`` slots. Where one was held for ``next_job``, whose
        batch of ``next_samples`` starts the next run, that job asks for the next slot in its
        turn right away (without this, two busy pipelines would just take turns, whatever their
        jobs' weights)."""
        scheduler = self._scheduler
        if scheduler is None:
            return
        next_cost = self._clock.cost(next_samples) if next_job is not None else 0.0
        held = self._held
        for _ in range(min(count, len(held.slots))):
            job_id = held.slots.pop(0)
            if job_id == next_job:
                scheduler.release(job_id, next_cost)
                held.kept_for = job_id  # the next run starts with this job's batch
                next_job = None
            else:
                scheduler.release(job_id)

    def give_up(self, jobs: set[int] | None) -> None:
        """Gives back every slot the calling instance holds or keeps; ``jobs``: the pipeline
        stops (no instance of it goes on), so every slot kept for these jobs goes back too."""
        self.give(self.held)
        scheduler = self._scheduler
        if scheduler is None:
            return
        if jobs is None:
            if self._held.kept_for is not None:
                scheduler.forfeit(self._held.kept_for)
                self._held.kept_for = None
            return
        for job_id in jobs:
            scheduler.forfeit(job_id)
