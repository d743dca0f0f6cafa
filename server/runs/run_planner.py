"""Which waiting batches of a pipeline's members form its next run, in the fair scheduler's
order, and how many of a job's batches the daemon holds at once (Note [A job's window]); the
batches, members and runs themselves are in :mod:`dalid.server.runs.runs`.

Why one module of some 600 lines: the window decides which batch may run next, so it lives
beside the choice it limits, in the one planner that several executors of a graph would share.

Note [A job's window]
---------------------
A DataLoader keeps ``workers x prefetch_factor`` batches submitted, and they reach the daemon out
of the trainer's order (each worker sends its own). Run in arrival order, they would fill the
job's output memory with batches the trainer cannot take yet, and the one it waits for would
find no room. So:

1. A member holds at most ``window`` batches at once (``Member.holding``): from the moment a batch
   is taken into a run until it is answered without a lease (failed, a private copy, its job
   gone) or the trainer has released every region of it. ``window`` is the pipeline's
   ``prefetch_queue_depth`` (what DALI in-process holds) for each DALI instance running
   the graph (``instances.py``: a job alone keeps them all busy only so) plus
   ``TRAINER_HOLDS``, the batch the trainer holds while it waits for the next, and no wider
   than its job's output memory allows (point 7). A member whose window is full is passed
   over, so no executor blocks in an allocation for it and other jobs run on.
2. The trainer names the batch it is about to wait for (``want_batch``). That batch goes to the
   front of its member's queue (or there when it arrives, if it comes later, or once admitted
   if the job's in-flight limit held it back: ``Admission.want``), and passes a full window:
   batches that arrived early cannot keep out the one the trainer needs. It may pass by
   ``TRAINER_HOLDS + 1`` batches: at an epoch's start the early batches can fill the whole
   window while the trainer holds none, and then it holds the batch it just had while it
   waits for the next one.
3. So the job's output memory holds ``window + 1`` batches in steady state (a batch in order
   passes a window the trainer's batch and DALI's prefetch fill), ``window + 2`` at most, and
   its pool grows no further (point 3 of Note [Output buffer lifetime] in pool.py); the quota
   stays the bound.
4. A trainer that keeps its outputs (Note [Private copies] in copies.py) holds the whole window
   and still waits: once its wanted batch has waited ``copy_after`` for the window, the member
   *overflows*: its batches pass the window, up to the pool's quota and then as private copies,
   until the trainer releases a batch again. A trainer that takes no copies waits.
5. A want is one integer per member, replaced by the next: a want for a batch the job does not
   have, has delivered, or another job's, finds nothing to move and grows nothing.
6. A worker that leaves takes its batches out of its job's window: those still queued are
   dropped (``DaemonCore.peer_disconnected``), and those delivered stop counting, though their
   memory stays leased until the trainer releases it or the job ends. A loop that leaves an
   epoch early (``for batch in loader: break``, a sanity check of a few batches) drops its
   iterator, whose workers leave with batches sent that the trainer will never ask for; the
   ones delivered wait unclaimed in the trainer, and counted, a few such loops would fill the
   window for good. A worker leaves at an epoch's end only after the trainer has asked for
   every batch it sent, so a batch that stops counting then is one the trainer holds (point
   1's ``TRAINER_HOLDS``) or keeps.
7. A member's window is also no wider than its job's output memory can hold with the two
   batches of point 2 beside it (``JobOutputs.batches_fit``, for batches the size of the one
   to take, at the sizes per sample of the pipeline's last run; a window of one until a run
   has told them): so every batch the window lets in finds room, and none waits in an
   allocation for a release the trainer makes only once it has the batch the trainer waits
   for, which may be queued in DALI behind it. Without it, a window widened by more
   instances, or a pool whose quota holds only a few batches, made the executor wait
   ``copy_after`` and send the batch as a private copy.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from dalid.protocol import BATCH_IDS_PER_CONNECTION, InputBatch

from ..samples.badsamples import oversized_images
from ..samples.packed import PackedSamples
from ..samples.paths import PATH_DTYPE_NAMES, FilesUnseen, check_paths
from . import wakes
from .runs import SENDERS_REMEMBERED, Member, PendingBatch, Run
from .scheduler import FairScheduler, ServiceClock

# How long an idle executor waits for a batch before it looks again, and how soon it looks
# again when a job's batch waited only for that job's memory (a release does not wake it).
_IDLE_WAIT_S = 1.0
_IDLE_POLL_S = 0.05

# The batch a trainer holds while it waits for its next one (Note [A job's window], point 1).
TRAINER_HOLDS = 1


def _any_batch(batch: PendingBatch) -> bool:
    return True


def _samples(item: InputBatch, paths: bool) -> np.ndarray | Sequence[np.ndarray]:
    """An input's samples as its batch keeps them: paths of several lengths left packed in
    their frame (``packed.py``), others viewed (``InputBatch.arrays``)."""
    if paths and item.ndim == 1 and item.dtype in PATH_DTYPE_NAMES and item.size:
        flat = np.frombuffer(item.data, item.dtype)
        if item.uniform():  # one length: one array, as InputBatch.arrays makes it
            return flat.reshape(item.size, -1)
        return PackedSamples(flat, item.sample_bytes())
    return item.arrays()


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

    ``members`` and their queues are guarded by ``changed``, which a submission notifies (in
    the daemon's receive turn, once the turn ends: Note [Waking executors after the turn's
    answers] in wakes.py). The
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
        # Counts the changes that may let a batch run (each one's notify): an executor that
        # found nothing to run waits only if none came since it looked (``_first_batch``).
        self._changes = 0
        self.shared = False
        self.run_size = 0
        # The inputs whose samples are file paths (checked before a batch runs).
        self.path_inputs: tuple[str, ...] = ()
        # Output sizes per sample of the last run, by output: (device, bytes).
        self.sample_sizes: list[tuple[str, int]] = []
        # The most batches of a member held at once (Note [A job's window]); 0: no limit.
        self.window = 0
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
        member = batch.member
        assert member is not None
        with self.changed:
            if batch.batch_id == member.wanted:
                member.queue.appendleft(batch)  # its trainer waits for it already
            else:
                member.queue.append(batch)
            self._signal()

    # --- the window (Note [A job's window]) -----------------------------------------------------

    def want(self, member: Member, batch_id: int) -> None:
        """``member``'s trainer waits for ``batch_id``: it goes to the front of the queue, now
        or when it arrives (point 2); a batch the member does not have queued moves nothing."""
        with self.changed:
            if member not in self.members:
                return
            member.wanted = batch_id
            member.want_blocked_since = None
            for index, batch in enumerate(member.queue):
                if batch.batch_id == batch_id:
                    if index:
                        del member.queue[index]
                        member.queue.appendleft(batch)
                    self._signal()
                    break

    def settle(self, batch: PendingBatch, released: bool = False) -> None:
        """``batch`` leaves its job's window: answered without a lease, or (``released``) its
        trainer released its regions, which also ends the member's overflow (point 4)."""
        member = batch.member
        assert member is not None
        with self.changed:
            if not batch.held:
                return
            batch.held = False
            member.holding.pop(batch.batch_id, None)
            if released:
                member.overflow = False
            self._signal()

    def sender_left(self, member: Member, first_id: int, end_id: int) -> None:
        """The worker that sent ``member``'s batches ``first_id <= id < end_id`` left: those
        held leave its window, their memory leased until released, and those still to run will
        not count in it (point 6)."""
        with self.changed:
            member.senders_left[first_id // BATCH_IDS_PER_CONNECTION] = None
            if len(member.senders_left) > SENDERS_REMEMBERED:
                del member.senders_left[next(iter(member.senders_left))]
            gone = [b for i, b in member.holding.items() if first_id <= i < end_id]
            for batch in gone:
                batch.held = False
                del member.holding[batch.batch_id]
            if gone:
                self._signal()

    @staticmethod
    def _hold(batch: PendingBatch) -> None:
        """Counts a batch just taken off its queue into its member's window (under
        ``changed``)."""
        member = batch.member
        assert member is not None
        if batch.batch_id == member.wanted:
            member.wanted = None
            member.want_blocked_since = None
        if batch.batch_id // BATCH_IDS_PER_CONNECTION in member.senders_left:
            return  # its worker left: nobody may ask for it (point 6)
        batch.held = True
        member.holding[batch.batch_id] = batch

    def _in_window(self, member: Member, head: PendingBatch) -> bool:
        """Whether ``member``'s queue head may be taken now, as far as its window goes."""
        window = self.window
        if not window or not member.held or member.overflow:
            return True
        window = self._window_of(member, head)
        if member.held < window:
            return True
        if head.batch_id != member.wanted:
            return False
        if member.held < window + TRAINER_HOLDS + 1:
            return True  # what the trainer waits for passes a full window (point 2)
        copy_after = member.outputs.copy_after
        if copy_after is None:
            return False  # a trainer that takes no copies waits for its releases
        now = time.monotonic()
        if member.want_blocked_since is None:
            member.want_blocked_since = now
        if now - member.want_blocked_since >= copy_after:
            member.overflow = True  # it keeps its outputs (point 4)
            return True
        self._starved = True
        return False

    def _window_of(self, member: Member, head: PendingBatch) -> int:
        """``member``'s window: the pipeline's, no wider than its job's output memory holds
        beside the batch its trainer holds and the one it waits for (point 7)."""
        if not self.sample_sizes:
            return 1  # the outputs' sizes are known once a run is out
        sizes = [(device, size * head.size) for device, size in self.sample_sizes]
        fits = member.outputs.batches_fit(sizes)
        return max(1, min(self.window, fits - TRAINER_HOLDS - 1))

    def wake(self) -> None:
        with self.changed:
            self._changes += 1
            self.changed.notify_all()

    def _signal(self) -> None:
        """Under ``changed``: something changed that may let a batch run; counted, and an
        executor woken (after the receive turn's answers, from the I/O thread: wakes.py)."""
        self._changes += 1
        wakes.notify(self.changed)

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
        # Riders are other jobs' batches: a pipeline with one member has none to look for.
        if len(self.members) < 2 or not self._mixes(first):
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
        # Read before the look: a submission (or release, or want) that lands between the look
        # and the wait below has notified no waiter yet, and must not be waited for.
        changes = self._changes
        batch = retry[0] if from_retry else self._pick(_any_batch, pop=False)
        if batch is None and block:
            with self.changed:
                if self._changes == changes:
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
                    self._hold(batch)
            if not taken:  # its job left meanwhile or its queue changed
                self.give_slots(1)
                return None
        self.prepare(batch)
        return batch

    def _pick(self, fits: Callable[[PendingBatch], bool], pop: bool) -> PendingBatch | None:
        """The head batch, among the members', whose job comes first in the scheduler's order
        (then the oldest), of those that ``fits`` allows; taken off its queue with ``pop``.

        The heads are put in that order first, from one read of the scheduler, and looked at
        in it until one may run: the looks at a job's window and memory (``_may_take``), a
        lock or two each, are made for the jobs before the one chosen, not for every job of
        the pipeline each time a run is formed (with eight jobs, eight of each a run). A job
        whose turn has not come is not looked at, so a starved job's wait
        (``Member.starved_since``, ``want_blocked_since``) counts from its turn's first
        refusal; it runs no sooner either way."""
        with self.changed:
            heads = [(m, m.queue[0]) for m in self.members if m.queue and not m.closed]
        if not heads:
            return None
        chosen = self._first_that_may_run(heads, fits, pop)
        if chosen is None:
            return None
        member, head = chosen
        if not pop:
            return head
        with self.changed:
            taken = bool(member.queue) and member.queue[0] is head
            if taken:
                member.queue.popleft()
                self._hold(head)
        if not taken:
            return None  # its job left meanwhile, or a want changed its queue
        return head

    def _order(self, heads: list[tuple[Member, PendingBatch]]) -> list[tuple[float, int]]:
        """The indexes of ``heads`` with their tags, in the scheduler's order (the smallest
        start tag, then the oldest batch); a job that has ended is left out. A member for
        which a slot is kept goes first; without a scheduler, the oldest batch."""
        scheduler = self._scheduler
        tags: list[float | None] = (
            scheduler.start_tags([member.job_id for member, _ in heads])
            if scheduler is not None
            else [0.0] * len(heads)
        )
        reserved = self._reserved
        order = []
        for index, ((member, _), found) in enumerate(zip(heads, tags, strict=True)):
            # A member for which a slot is kept goes first.
            tag = -1.0 if member.job_id == reserved else found
            if tag is not None:
                order.append((tag, index))
        order.sort(key=lambda entry: (entry[0], heads[entry[1]][1].arrival))
        return order

    def _first_that_may_run(
        self,
        heads: list[tuple[Member, PendingBatch]],
        fits: Callable[[PendingBatch], bool],
        pop: bool,
    ) -> tuple[Member, PendingBatch] | None:
        for tag, index in self._order(heads):
            member, head = heads[index]
            if pop:
                self.prepare(head)  # a rider's images are checked before it may ride
            if not fits(head) or not self._may_take(member, head):
                continue
            if tag >= 0 and not pop and self._behind_waits(member.job_id, tag):
                continue
            return member, head
        return None

    def _behind_waits(self, job_id: int, tag: float) -> bool:
        """Whether a run for a cohort's member past the window waits (Note [Cohort outputs],
        point 8, in cohorts.py): not while this instance has a run in flight, unless its turn
        came (no other member's tag is earlier). Else a run of it started in a moment the
        others left the pipeline would keep out their next batch, which cannot preempt it."""
        scheduler = self._scheduler
        if scheduler is None or not self._slots_held or not scheduler.behind(job_id):
            return False
        with self.changed:
            others = [m.job_id for m in self.members if m.job_id != job_id]
        tags = [scheduler.start_tag(other) for other in others]
        return any(other is not None and other < tag for other in tags)

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
        """Whether ``member``'s next batch may run now: within its window, and on a pipeline
        other jobs share, only if the job's output memory has room for it: a job whose trainer
        holds all its buffers waits for them, and must not stop the pipeline while it does."""
        if not self._in_window(member, head):
            return False
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
            batch.arrays = {
                item.name: _samples(item, item.name in self.path_inputs)
                for item in batch.request.inputs
            }
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
