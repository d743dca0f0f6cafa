"""Weighted fair sharing of the daemon between jobs: who runs the next batch.

The daemon runs at most ``slots`` batches at once, across all jobs. A pipeline's executor takes
a slot before it hands a batch to DALI and gives it back once the batch's outputs are written.
When slots are short, they go by start-time fair queueing (Goyal, Vin and Cheng, 1996): each
request gets a virtual start tag, ``max(V, finish tag of the job's previous request)``, and its
job's finish tag moves on by ``cost / weight``. The cost is the time the batch is expected to
keep the daemon busy (its samples times what a sample of its pipeline took lately: see
``ServiceClock``), so a job whose samples are heavier gets fewer of them, not more of the
daemon. The waiting request with the smallest start tag is served next, and the virtual time
``V`` becomes its tag. So busy jobs share the daemon's time in proportion to their weights,
and a job that was idle comes back at ``V``: it cannot save up a credit, and a job that floods
the daemon only pushes its own tags ahead, so a steady job's next batch waits at most for the
batches already running. What each job's batches did take is kept as its ``run_seconds``.

A pipeline that several jobs share runs batches of several jobs at once (a *run*): the run holds
one slot, taken for the batch of the smallest start tag, and each other batch in it *rides*
along, charged to its job as if granted (``ride``), so that weights hold inside shared runs.

An executor may hold several slots (its prefetch depth). It blocks for a slot only while it
holds none; with a batch in flight it only tries, and collects that batch if it may not start
another. A blocked executor thus never holds a slot, and the slots cannot deadlock.

A job that gives a slot back with more work ready says so (``release(next_cost=...)``): its
next request then competes for that very slot, by its tag, before the slot goes to anyone else.
Without this, the slot would always pass to whoever else waits, and two busy jobs would simply
alternate whatever their weights. A slot won that way is held for the job (``reserved``) until
one of its executors takes it.

A cohort's member that trails the others past the cohort's window (Note [Cohort outputs] in
cohorts.py; docs/design/cohort-outputs.md, "Past the window") is *behind*: its batches run for
it alone, and its tags move on at ``BEHIND_SHARE`` of its weight, so the cohort's shared runs
come first and it takes what they leave, with that fraction of a weight as its floor. It is
still served in its turn: never starved, and work-conserving (a daemon the others leave idle
is its).

The clock that prices its requests (``ServiceClock``) lives beside the fair queue: a tag
means nothing without the cost it moved by.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# How often a blocked request checks whether it was cancelled.
CANCEL_POLL_S = 0.1

# The fraction of its weight a cohort's member past the window competes with: with three members
# in step splitting their runs' cost, one behind them takes about 3% of a saturated daemon.
BEHIND_SHARE = 0.1


@dataclass
class _Request:
    job_id: int
    start_tag: float
    cost: float
    sequence: int
    since: float
    passed_over: int = 0
    # Made by release(next_cost=...): no thread waits on it, its slot is kept for the job.
    reservation: bool = False


@dataclass
class _JobShare:
    weight: float
    finish_tag: float = 0.0
    running: int = 0
    # Slots won for the job that none of its executors has taken yet.
    reserved: int = 0
    # Executor threads blocked in acquire.
    claimants: int = 0
    granted: int = 0
    waited_seconds: float = 0.0
    passed_over: int = 0
    run_seconds: float = 0.0
    waiting: list[_Request] = field(default_factory=list)
    # A cohort's member past the window (set_behind): its tags move on at BEHIND_SHARE pace.
    behind: bool = False

    @property
    def pace(self) -> float:
        """The weight its tags move on by: its weight, or a fraction of it while behind."""
        return self.weight * BEHIND_SHARE if self.behind else self.weight


@dataclass(frozen=True)
class ShareStats:
    """A job's scheduling so far: slots it holds, how long and behind how many it waited, and
    the daemon's time its batches took."""

    running: int
    granted: int
    waited_seconds: float
    passed_over: int
    run_seconds: float


class FairScheduler:
    """Start-time fair queueing of batches over ``slots`` run slots. Thread-safe."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a scheduler needs at least one slot, got {slots}")
        self.slots = slots
        self._free = slots
        self._virtual_time = 0.0
        self._jobs: dict[int, _JobShare] = {}
        self._sequence = itertools.count()
        self._changed = threading.Condition()

    def add_job(self, job_id: int, weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"a job's weight must be positive, got {weight}")
        with self._changed:
            self._jobs[job_id] = _JobShare(weight)

    def remove_job(self, job_id: int) -> None:
        """Forgets a job; its blocked requests return False. Its slots come back on release."""
        with self._changed:
            share = self._jobs.pop(job_id, None)
            if share is not None:
                self._free += share.running + share.reserved
                share.waiting.clear()
                self._grant_waiting()
                self._changed.notify_all()

    def acquire(
        self, job_id: int, cost: float, *, block: bool, cancelled: Callable[[], bool]
    ) -> bool:
        """Takes a slot for a batch of ``cost`` samples; whether it got one.

        With ``block``, waits for its turn until ``cancelled()`` or the job's removal; call it
        so only while the caller holds no slot. Without, takes a slot only if one is kept for
        the job, or one is free and no waiting request of any job comes before this one.
        """
        with self._changed:
            share = self._jobs.get(job_id)
            if share is None:
                return False
            if self._take_reserved(share):
                return True
            start_tag = max(self._virtual_time, share.finish_tag)
            if self._free > 0 and not any(
                self._before(waiting, start_tag) for waiting in self._all_waiting()
            ):
                self._start(share, start_tag, cost)
                return True
            if not block:
                return False
            # Grants go to the job, not to a thread: a request made at an earlier release may
            # serve this caller, and a new one is made only if every pending one is spoken for.
            share.claimants += 1
            if len(share.waiting) < share.claimants:
                request = _Request(job_id, start_tag, cost, next(self._sequence), time.monotonic())
                # The tag is taken now, so the job's next request queues behind this one.
                share.finish_tag = start_tag + cost / share.pace
                share.waiting.append(request)
                self._grant_waiting()
            while not self._take_reserved(share):
                if cancelled() or self._jobs.get(job_id) is not share:
                    share.claimants -= 1
                    unclaimed = [r for r in share.waiting if not r.reservation]
                    if len(share.waiting) > share.claimants and unclaimed:
                        share.waiting.remove(unclaimed[-1])
                    self._changed.notify_all()
                    return False
                self._changed.wait(CANCEL_POLL_S)
            share.claimants -= 1
            return True

    def release(self, job_id: int, next_cost: float | None = None) -> None:
        """Gives back a slot the job holds (a no-op for a removed job).

        ``next_cost``: the job has another batch of about that many samples ready, and asks for
        a slot for it now, in its turn; its next ``acquire`` then takes the slot it won.
        """
        with self._changed:
            share = self._jobs.get(job_id)
            if share is None or share.running == 0:
                return
            share.running -= 1
            self._free += 1
            if next_cost is not None:
                start_tag = max(self._virtual_time, share.finish_tag)
                share.finish_tag = start_tag + next_cost / share.pace
                share.waiting.append(
                    _Request(
                        job_id,
                        start_tag,
                        next_cost,
                        next(self._sequence),
                        time.monotonic(),
                        reservation=True,
                    )
                )
            self._grant_waiting()

    def weight(self, job_id: int) -> float:
        """The job's weight (1 for a removed job)."""
        with self._changed:
            share = self._jobs.get(job_id)
            return share.weight if share is not None else 1.0

    def set_behind(self, job_id: int, behind: bool) -> None:
        """Marks a cohort's member past the cohort's window (or back within it): its next
        requests compete at ``BEHIND_SHARE`` of its weight (or at all of it again). Back, its
        next tag starts from the virtual time at the latest: a member that caught up does not
        wait out the tags its runs took while behind (each of them ten times its cost)."""
        with self._changed:
            share = self._jobs.get(job_id)
            if share is not None:
                if share.behind and not behind:
                    share.finish_tag = min(share.finish_tag, self._virtual_time)
                share.behind = behind

    def behind(self, job_id: int) -> bool:
        with self._changed:
            share = self._jobs.get(job_id)
            return share is not None and share.behind

    def start_tag(self, job_id: int) -> float | None:
        """The start tag the job's next request would get (None for a removed job): a pipeline
        shared by several jobs serves them in the order of these tags."""
        with self._changed:
            share = self._jobs.get(job_id)
            if share is None:
                return None
            return max(self._virtual_time, share.finish_tag)

    def start_tags(self, job_ids: Sequence[int]) -> list[float | None]:
        """``start_tag`` of each job, read at one moment (one lock for a pipeline's members)."""
        with self._changed:
            now = self._virtual_time
            shares = [self._jobs.get(job_id) for job_id in job_ids]
            return [None if s is None else max(now, s.finish_tag) for s in shares]

    def ride(self, job_id: int, cost: float) -> None:
        """Charges a batch of the job that runs in a slot another batch holds (a run of a shared
        pipeline holds one slot for all its batches): its tag moves on as if it had been granted
        a slot of its own, so weights hold inside shared runs too."""
        with self._changed:
            share = self._jobs.get(job_id)
            if share is None:
                return
            # The virtual time stays the run's (its first batch's start tag): a rider's later
            # tag moved it on, and other jobs' next tags with it, as if they had been served.
            start_tag = max(self._virtual_time, share.finish_tag)
            share.finish_tag = start_tag + cost / share.pace
            share.granted += 1

    def forfeit(self, job_id: int) -> None:
        """Gives back the slots kept for the job, and drops the requests no executor waits on.

        For an executor that stops while its job goes on."""
        with self._changed:
            share = self._jobs.get(job_id)
            if share is None:
                return
            share.waiting = share.waiting[: share.claimants]
            kept = share.reserved - share.claimants
            if kept > 0:
                self._free += kept
                share.reserved -= kept
            self._grant_waiting()

    def stats(self, job_id: int) -> ShareStats:
        with self._changed:
            share = self._jobs.get(job_id)
            if share is None:
                return ShareStats(0, 0, 0.0, 0, 0.0)
            return ShareStats(
                share.running + share.reserved,
                share.granted,
                share.waited_seconds,
                share.passed_over,
                share.run_seconds,
            )

    def charge(self, job_id: int, seconds: float) -> None:
        """Counts ``seconds`` of the daemon's time, taken by a batch of the job, to the job."""
        with self._changed:
            share = self._jobs.get(job_id)
            if share is not None:
                share.run_seconds += seconds

    def share_run(self, job_id: int, seconds: float) -> None:
        """Counts ``seconds`` of a run another job's slot paid for to the job, as if it had
        run them (a cohort's run, split among the members it served: cohorts.py): its
        ``run_seconds`` and its finish tag move on; negative, the payer's share shrinks and
        both move back. A tag moved back below the virtual time changes nothing: a job cannot
        save up a credit."""
        with self._changed:
            share = self._jobs.get(job_id)
            if share is not None:
                share.run_seconds += seconds
                share.finish_tag += seconds / share.pace

    @property
    def free(self) -> int:
        with self._changed:
            return self._free

    # --- under the lock -------------------------------------------------------------------------

    @staticmethod
    def _take_reserved(share: _JobShare) -> bool:
        """Takes a slot won for the job, if there is one."""
        if not share.reserved:
            return False
        share.reserved -= 1
        share.running += 1
        return True

    def _all_waiting(self) -> itertools.chain[_Request]:
        return itertools.chain.from_iterable(share.waiting for share in self._jobs.values())

    @staticmethod
    def _before(request: _Request, start_tag: float) -> bool:
        return request.start_tag <= start_tag

    def _start(self, share: _JobShare, start_tag: float, cost: float) -> None:
        """Gives ``share`` a slot for a request that did not wait."""
        self._free -= 1
        self._virtual_time = max(self._virtual_time, start_tag)
        share.finish_tag = start_tag + cost / share.pace
        share.running += 1
        share.granted += 1
        self._count_passed_over(share)

    def _grant_waiting(self) -> None:
        """Hands free slots to waiting requests, smallest start tag first."""
        granted = False
        while self._free > 0:
            waiting = list(self._all_waiting())
            if not waiting:
                break
            # Among equal start tags the request that finishes first goes first, which favours
            # the job asking for less (a steady job's small batch over a flood's large one).
            request = min(
                waiting,
                key=lambda r: (
                    r.start_tag,
                    r.start_tag + r.cost / self._jobs[r.job_id].pace,
                    r.sequence,
                ),
            )
            share = self._jobs[request.job_id]
            share.waiting.remove(request)
            self._free -= 1
            self._virtual_time = max(self._virtual_time, request.start_tag)
            share.reserved += 1  # taken by the job's next acquire
            share.granted += 1
            share.waited_seconds += time.monotonic() - request.since
            share.passed_over += request.passed_over
            self._count_passed_over(share)
            granted = True
        if granted:
            self._changed.notify_all()

    def _count_passed_over(self, served: _JobShare) -> None:
        """Every request of another job still waiting was passed over once more."""
        for share in self._jobs.values():
            if share is not served:
                for request in share.waiting:
                    request.passed_over += 1


@dataclass(frozen=True)
class JobSlots:
    """One job's door to the scheduler, handed to its pipelines' executors."""

    scheduler: FairScheduler
    job_id: int

    def acquire(self, cost: float, *, block: bool, cancelled: Callable[[], bool]) -> bool:
        return self.scheduler.acquire(self.job_id, cost, block=block, cancelled=cancelled)

    def release(self, next_cost: float | None = None) -> None:
        self.scheduler.release(self.job_id, next_cost)

    def forfeit(self) -> None:
        self.scheduler.forfeit(self.job_id)

    def charge(self, seconds: float) -> None:
        self.scheduler.charge(self.job_id, seconds)


class ServiceClock:
    """What a sample of one pipeline costs the daemon, learnt from the batches it ran.

    A batch's service time runs from when it went into DALI, or from when the batch before it
    came out if that was later (batches in flight overlap; each is charged only the time after
    its predecessor), to when its outputs come out. The estimate per sample is a moving average,
    so it follows a pipeline whose samples change; until the first batch it is a guess.
    """

    # A guess for a pipeline that has run nothing yet: a small decoded image on one CPU core.
    INITIAL_SECONDS_PER_SAMPLE = 0.001
    # Weight of the newest batch in the moving average.
    SMOOTHING = 0.2

    def __init__(self) -> None:
        self.seconds_per_sample = self.INITIAL_SECONDS_PER_SAMPLE
        self._measured = False
        self._last_done: float | None = None

    def cost(self, samples: int) -> float:
        """The expected service time of a batch of ``samples``."""
        return samples * self.seconds_per_sample

    def batch_done(self, samples: int, entered: float, done: float) -> float:
        """Learns from a batch that went into DALI at ``entered`` and came out at ``done``
        (monotonic seconds); returns its service time."""
        start = entered if self._last_done is None else max(entered, self._last_done)
        self._last_done = done
        service = max(done - start, 0.0)
        if samples > 0:
            # Never free: a zero estimate would take a pipeline out of the weighing altogether.
            per_sample = max(service / samples, 1e-6)
            if self._measured:
                self.seconds_per_sample += self.SMOOTHING * (per_sample - self.seconds_per_sample)
            else:
                self.seconds_per_sample = per_sample
                self._measured = True
        return service

    def interrupted(self) -> None:
        """The batches in flight were dropped (a failure): the next one starts afresh."""
        self._last_done = None
