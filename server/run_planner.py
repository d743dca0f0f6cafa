"""Which waiting batches of a pipeline's members form its next run, in the fair scheduler's
order; the batches, members and runs themselves are in :mod:`dalid.server.runs`.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from .badsamples import oversized_images
from .paths import FilesUnseen, check_paths
from .runs import Member, PendingBatch, Run
from .scheduler import FairScheduler, ServiceClock

# How long an idle executor waits for a batch before it looks again, and how soon it looks
# again when a job's batch waited only for that job's memory (a release does not wake it).
_IDLE_WAIT_S = 1.0
_IDLE_POLL_S = 0.05


def _any_batch(batch: PendingBatch) -> bool:
    return True


class RunPlanner:
    """The members of one pipeline, their waiting batches, and which of them form its next run.

    Each run starts with the batch whose job comes first in the fair scheduler's order, and
    takes a slot of the scheduler for it (``FairScheduler.acquire``). On a shared pipeline the
    run then takes batches of other members, in the scheduler's order, while they fit in
    ``run_size`` samples and feed DALI inputs of the same dtypes and ranks: at most one batch
    of each job, so that a job alone gets runs that are exactly its batches, as DALI's proxy
    runs them (operators whose result depends on a sample's place in its run, such as the
    mixed decoder's split between its hardware and CUDA decoders, then give what they give
    there), and a job's backlog does not fill a run while another job's next batch is on its
    way. Riders ride in that slot, each charged to its own job (``FairScheduler.ride``), so
    weights hold inside runs. A batch that ran in a mixed run that failed, or of a job in
    quarantine, runs alone.

    ``members`` and their queues are guarded by ``changed``, which a submission notifies. The
    pipeline's DALI instances (``executor.py``) form runs from the same queues, each in a
    thread of its own; the slots each holds, and the one kept for its next run, are its
    thread's (``_Seat``), so one instance never gives back or waits on another's.
    """

    def __init__(
        self,
        scheduler: FairScheduler | None,
        clock: ServiceClock,
        stopping: threading.Event,
        max_image_pixels: int,
    ) -> None:
        self.members: list[Member] = []
        self.changed = threading.Condition()
        self.shared = False
        self.run_size = 0
        # The inputs whose samples are file paths (checked before a batch runs).
        self.path_inputs: tuple[str, ...] = ()
        # Output sizes per sample of the last run, by output: (device, bytes).
        self.sample_sizes: list[tuple[str, int]] = []
        self._scheduler = scheduler
        self._clock = clock
        self._stopping = stopping
        self._max_image_pixels = max_image_pixels
        self._seat = _Seat()

    # What a DALI instance holds of the scheduler lives in its thread's seat.

    @property
    def _slots_held(self) -> list[int]:
        return self._seat.slots_held

    @property
    def _reserved(self) -> int | None:
        return self._seat.reserved

    @_reserved.setter
    def _reserved(self, job_id: int | None) -> None:
        self._seat.reserved = job_id

    @property
    def _starved(self) -> bool:
        return self._seat.starved

    @_starved.setter
    def _starved(self, starved: bool) -> None:
        self._seat.starved = starved

    # --- members --------------------------------------------------------------------------------

    def add(self, member: Member) -> None:
        with self.changed:
            self.members.append(member)

    def remove(self, member: Member) -> bool:
        """Forgets ``member`` and its queued batches; whether it was the last one."""
        with self.changed:
            if member in self.members:
                self.members.remove(member)
            member.queue.clear()
            return not self.members

    def submit(self, batch: PendingBatch) -> None:
        assert batch.member is not None
        with self.changed:
            batch.member.queue.append(batch)
            self.changed.notify()

    def wake(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def take_queued(self) -> list[PendingBatch]:
        """Every queued batch, taken off its queue (a pipeline that stopped working)."""
        with self.changed:
            queued = [batch for member in self.members for batch in member.queue]
            for member in self.members:
                member.queue.clear()
        return queued

    # --- runs -----------------------------------------------------------------------------------

    def next_run(self, retry: collections.deque[PendingBatch], block: bool) -> Run | None:
        """The next run, its slot taken: batches of ``retry`` first. None when nothing may run
        now (``block``: after waiting a while for something to)."""
        first = self._first_batch(retry, block)
        if first is None:
            return None
        assert first.member is not None
        run = Run([first], first.member.job_id)
        if not self._mixes(first):
            return run
        room = self.run_size - first.size
        kinds = first.input_kinds()
        taken = {first.member.job_id}  # one batch of a job in a run: its runs are its batches
        # A job rides only while its tag is not past the end of the first batch's: a job that
        # rode every run would get more than its weight, as one batch a run is all it can have.
        due = self._scheduler.start_tag(first.member.job_id) if self._scheduler else None

        def rides(batch: PendingBatch) -> bool:
            member = batch.member
            return (
                member is not None
                and member.alone == 0
                and not batch.alone
                and not batch.oversized
                and not batch.unseen
                and batch.size <= room
                and member.job_id not in taken
                and self._is_due(member.job_id, due)
                and batch.input_kinds() == kinds
            )

        while room > 0:
            rider = self._pick(rides, pop=True)
            if rider is None:
                break
            assert rider.member is not None
            if self._scheduler is not None:
                self._scheduler.ride(rider.member.job_id, self._clock.cost(rider.size))
            run.batches.append(rider)
            taken.add(rider.member.job_id)
            room -= rider.size
        return run

    def _is_due(self, job_id: int, due: float | None) -> bool:
        if self._scheduler is None or due is None:
            return True
        tag = self._scheduler.start_tag(job_id)
        return tag is not None and tag <= due + 1e-12

    def _first_batch(
        self, retry: collections.deque[PendingBatch], block: bool
    ) -> PendingBatch | None:
        from_retry = bool(retry)
        self._starved = False
        batch = retry[0] if from_retry else self._pick(_any_batch, pop=False)
        if batch is None and block:
            with self.changed:
                self.changed.wait(_IDLE_POLL_S if self._starved else _IDLE_WAIT_S)
            # Most often a submission woke us: take its batch now, not on the next call.
            batch = None if self._stopping.is_set() else self._pick(_any_batch, pop=False)
        if batch is None:
            return None
        assert batch.member is not None
        if not self._take_slot(batch.member.job_id, batch.size, block=block):
            if block:
                self._stopping.wait(_IDLE_POLL_S)  # another job's turn
            return None
        if from_retry:
            retry.popleft()
        else:
            with self.changed:
                taken = bool(batch.member.queue) and batch.member.queue[0] is batch
                if taken:
                    batch.member.queue.popleft()
            if not taken:  # its job left meanwhile
                self.give_slots(1)
                return None
        self.prepare(batch)
        return batch

    def _pick(self, fits: Callable[[PendingBatch], bool], pop: bool) -> PendingBatch | None:
        """The head batch, among the members', whose job comes first in the scheduler's order
        (then the oldest), of those that ``fits`` allows; taken off its queue with ``pop``."""
        with self.changed:
            heads = [(m, m.queue[0]) for m in self.members if m.queue and not m.closed]
        best: tuple[float, int] | None = None
        chosen: tuple[Member, PendingBatch] | None = None
        for member, head in heads:
            if pop:
                self.prepare(head)  # a rider's images are checked before it may ride
            if not fits(head) or not self._may_take(member, head):
                continue
            tag = 0.0
            if member.job_id == self._reserved:
                tag = -1.0  # a slot is kept for it: its batch goes first
            elif self._scheduler is not None:
                found = self._scheduler.start_tag(member.job_id)
                if found is None:
                    continue  # its job has ended
                tag = found
            if best is None or (tag, head.arrival) < best:
                best, chosen = (tag, head.arrival), (member, head)
        if chosen is None:
            return None
        member, head = chosen
        if not pop:
            return head
        with self.changed:
            taken = bool(member.queue) and member.queue[0] is head
            if taken:
                member.queue.popleft()
        if not taken:
            return None  # its job left meanwhile
        return head

    def _mixes(self, first: PendingBatch) -> bool:
        member = first.member
        return (
            self.shared
            and not first.alone
            and not first.oversized
            and not first.unseen
            and member is not None
            and not member.deterministic
            and member.alone == 0
        )

    def _may_take(self, member: Member, head: PendingBatch) -> bool:
        """Whether ``member``'s next batch may run now. On a pipeline other jobs share, only if
        the job's output memory has room for it: a job whose trainer holds all its buffers
        waits for them, and must not stop the pipeline while it does."""
        if not self.shared or len(self.members) < 2 or not self.sample_sizes:
            return True
        sizes = [(device, size * head.size) for device, size in self.sample_sizes]
        if member.outputs.has_room(sizes):
            member.starved_since = None
            return True
        # A trainer that takes private copies gets them once it has held everything for a
        # while (Note [Private copies] in copies.py): a loop that keeps its outputs never hangs.
        copy_after = member.outputs.copy_after
        now = time.monotonic()
        if member.starved_since is None:
            member.starved_since = now
        if copy_after is not None and now - member.starved_since >= copy_after:
            return True
        self._starved = True
        return False

    def prepare(self, batch: PendingBatch) -> None:
        """Views the batch's frames as arrays, and finds the samples known bad before a run:
        image samples over the pixel limit, files nobody can read (or that the daemon cannot
        see, which fails the batch: ``unseen``)."""
        if not batch.arrays:
            batch.arrays = {item.name: item.arrays() for item in batch.request.inputs}
        if batch.oversized is None:
            bad = oversized_images(batch.arrays, self._max_image_pixels, self.path_inputs)
            if self.path_inputs:
                try:
                    found = check_paths(
                        batch.request.inputs, self.path_inputs, batch.request.unreadable
                    )
                except FilesUnseen as unseen:
                    batch.unseen = str(unseen)
                else:
                    bad = {**found, **bad}
            batch.oversized = bad

    # --- slots ----------------------------------------------------------------------------------

    def _take_slot(self, job_id: int, samples: int, block: bool) -> bool:
        if self._scheduler is None:
            return True
        if self._reserved is not None and self._reserved != job_id:
            # The slot kept for another job of this pipeline goes back, or this executor could
            # wait for a slot that only it could take.
            self._scheduler.forfeit(self._reserved)
        self._reserved = None
        cost = self._clock.cost(samples)
        if not self._scheduler.acquire(job_id, cost, block=block, cancelled=self._stopping.is_set):
            return False
        self._slots_held.append(job_id)
        return True

    def give_slots(self, count: int, retry: collections.deque[PendingBatch] | None = None) -> None:
        """Gives back the oldest ``count`` slots. With ``retry``, where the job that held one
        has the batch that starts the next run ready, it asks for the next slot in its turn
        right away (without this, two busy pipelines would just take turns, whatever their
        jobs' weights)."""
        if self._scheduler is None:
            return
        next_job, next_cost = None, 0.0
        if retry is not None:
            batch = retry[0] if retry else self._pick(_any_batch, pop=False)
            if batch is not None and batch.member is not None:
                next_job, next_cost = batch.member.job_id, self._clock.cost(batch.size)
        for _ in range(min(count, len(self._slots_held))):
            job_id = self._slots_held.pop(0)
            if job_id == next_job:
                self._scheduler.release(job_id, next_cost)
                self._reserved = job_id  # the next run starts with this job's batch
                next_job = None
            else:
                self._scheduler.release(job_id)

    def give_up(self, last: bool = True) -> None:
        """Gives back every slot the calling instance holds or keeps; ``last``: the pipeline
        stops (no instance of it goes on), so every slot kept for its jobs goes back too."""
        self.give_slots(len(self._slots_held))
        if self._scheduler is None:
            return
        if not last:
            if self._reserved is not None:
                self._scheduler.forfeit(self._reserved)
                self._reserved = None
            return
        for job_id in {member.job_id for member in list(self.members)}:
            self._scheduler.forfeit(job_id)


class _Seat(threading.local):
    """What one DALI instance of a pipeline holds of the scheduler, kept per thread: each
    instance forms and runs its runs in a thread of its own."""

    def __init__(self) -> None:
        self.slots_held: list[int] = []  # the job each held slot was taken for, oldest first
        # The job a slot is kept for (release(next_cost=...)), whose batch starts the next run.
        self.reserved: int | None = None
        # A member's batch waited because its job's memory was full: look again soon.
        self.starved = False
