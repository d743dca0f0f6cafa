"""Which waiting batches of a pipeline's members form its next run, in the fair scheduler's
order, within each job's window (``job_window.py``) and with the scheduler's slots
(``slots.py``); the batches, members and runs themselves are in :mod:`dalid.server.runs.runs`.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence

import numpy as np

from dalid.protocol import InputBatch

from ..pipelines.sizes import SizedOutput, size_refusal
from ..samples.badsamples import oversized_images
from ..samples.packed import PackedSamples
from ..samples.paths import PATH_DTYPE_NAMES, FilesTooLarge, FilesUnseen, check_paths
from . import wakes
from .job_window import TRAINER_HOLDS, JobWindow, Take
from .runs import Member, PendingBatch, Run
from .scheduler import FairScheduler, ServiceClock
from .slots import Slots

__all__ = ["TRAINER_HOLDS", "RunPlanner"]

# How long an idle executor waits for a batch before it looks again, and how soon it looks
# again when a job's batch waited only for that job's memory (a release does not wake it).
_IDLE_WAIT_S = 1.0
_IDLE_POLL_S = 0.05


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
    answers] in wakes.py); so are the members' windows (``job_window``). The pipeline's DALI
    instances (``executor.py``) form runs from the same queues, each in a thread of its own;
    the slots each holds are its thread's (``slots``).
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
        # The operators whose output sizes come from inputs (checked before a batch runs).
        self.sized_outputs: tuple[SizedOutput, ...] = ()
        self.job_window = JobWindow()
        self.slots = Slots(scheduler, clock, stopping)
        self._scheduler = scheduler
        self._clock = clock
        self._stopping = stopping
        self._max_image_pixels = max_image_pixels
        self._looks = _Looks()

    @property
    def window(self) -> int:
        """The most batches of a member held at once (Note [A job's window]); 0: no limit."""
        return self.job_window.window

    @window.setter
    def window(self, window: int) -> None:
        self.job_window.window = window

    @property
    def sample_sizes(self) -> list[tuple[str, int]]:
        """Output sizes per sample of the last run, by output: (device, bytes)."""
        return self.job_window.sample_sizes

    @sample_sizes.setter
    def sample_sizes(self, sizes: list[tuple[str, int]]) -> None:
        self.job_window.sample_sizes = sizes

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

    def members_now(self) -> list[Member]:
        """The members, as they are now."""
        with self.changed:
            return list(self.members)

    def first_member(self) -> Member | None:
        with self.changed:
            return self.members[0] if self.members else None

    def waiting(self) -> bool:
        """Whether a member has batches queued."""
        with self.changed:
            return any(member.queue for member in self.members)

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
        or when it arrives; a batch the member does not have queued moves nothing."""
        with self.changed:
            if member not in self.members:
                return
            self.job_window.want(member, batch_id)
            for index, batch in enumerate(member.queue):
                if batch.batch_id == batch_id:
                    if index:
                        del member.queue[index]
                        member.queue.appendleft(batch)
                    self._signal()
                    break

    def settle(self, batch: PendingBatch, released: bool = False) -> None:
        """``batch`` leaves its job's window: answered without a lease, or (``released``) its
        trainer released its regions, which also ends the member's overflow."""
        with self.changed:
            if self.job_window.settle(batch, released):
                self._signal()

    def sender_left(self, member: Member, first_id: int, end_id: int) -> None:
        """The worker that sent ``member``'s batches ``first_id <= id < end_id`` left: those
        held leave its window, their memory leased until released, and those still to run will
        not count in it."""
        with self.changed:
            if self.job_window.sender_left(member, first_id, end_id):
                self._signal()

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
                and member.quarantine == 0
                and not batch.runs_alone
                and not batch.oversized
                and not batch.refused
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
        self._looks.starved = False
        # Read before the look: a submission (or release, or want) that lands between the look
        # and the wait below has notified no waiter yet, and must not be waited for.
        changes = self._changes
        batch = retry[0] if from_retry else self._pick(_any_batch, pop=False)
        if batch is None and block:
            with self.changed:
                if self._changes == changes:
                    self.changed.wait(_IDLE_POLL_S if self._looks.starved else _IDLE_WAIT_S)
            # Most often a submission woke us: take its batch now, not on the next call.
            batch = None if self._stopping.is_set() else self._pick(_any_batch, pop=False)
        if batch is None:
            return None
        assert batch.member is not None
        if not self.slots.take(batch.member.job_id, batch.size, block=block):
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
                    self.job_window.hold(batch)
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
                self.job_window.hold(head)
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
        reserved = self.slots.kept_for
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
        """Whether a run for a cohort's member past the window waits (Note [Cohort outputs]
        in cohorts.py): not while this instance has a run in flight, unless its turn
        came (no other member's tag is earlier). Else a run of it started in a moment the
        others left the pipeline would keep out their next batch, which cannot preempt it."""
        scheduler = self._scheduler
        if scheduler is None or not self.slots.held or not scheduler.behind(job_id):
            return False
        with self.changed:
            others = [m.job_id for m in self.members if m.job_id != job_id]
        tags = [scheduler.start_tag(other) for other in others]
        return any(other is not None and other < tag for other in tags)

    def _mixes(self, first: PendingBatch) -> bool:
        member = first.member
        return (
            self.shared
            and not first.runs_alone
            and not first.oversized
            and not first.refused
            and member is not None
            and not member.deterministic
            and member.quarantine == 0
        )

    def _may_take(self, member: Member, head: PendingBatch) -> bool:
        """Whether ``member``'s next batch may run now: within its window, and on a pipeline
        other jobs share, only if the job's output memory has room for it (``JobWindow.room``).
        A refusal that ends by itself soon has the executor look again soon."""
        take = self.job_window.check(member, head)
        if take is Take.YES and self.shared and len(self.members) >= 2:
            take = self.job_window.room(member, head)
        if take is Take.NOT_YET:
            self._looks.starved = True
        return take is Take.YES

    def prepare(self, batch: PendingBatch) -> None:
        """Views the batch's frames as arrays, and finds the samples known bad before a run:
        image samples over the pixel limit, files nobody can read; and what fails the batch
        before DALI sees it (``refused``): files the daemon cannot see, more bytes of files
        than its job may have read at once, or sizes from its inputs that make more outputs
        than its job can hold (Note [Size inputs are a lower bound] in sizes.py)."""
        if not batch.arrays:
            batch.arrays = {
                item.name: _samples(item, item.name in self.path_inputs)
                for item in batch.request.inputs
            }
        if batch.oversized is None:
            bad = oversized_images(batch.arrays, self._max_image_pixels, self.path_inputs)
            if self.path_inputs:
                member = batch.member
                try:
                    found = check_paths(
                        batch.request.inputs,
                        self.path_inputs,
                        batch.request.unreadable,
                        max_read_bytes=member.read_bytes if member is not None else 0,
                    )
                except (FilesUnseen, FilesTooLarge) as refusal:
                    batch.refused = str(refusal)
                else:
                    bad = {**found, **bad}
            if self.sized_outputs and not batch.refused:
                member = batch.member
                batch.refused = size_refusal(
                    self.sized_outputs,
                    batch.request.inputs,
                    member.output_bytes if member is not None else 0,
                    self._max_image_pixels,
                )
            batch.oversized = bad

    # --- slots ----------------------------------------------------------------------------------

    def give_slots(self, count: int, retry: collections.deque[PendingBatch] | None = None) -> None:
        """Gives back the oldest ``count`` slots. With ``retry``, where the job that held one
        has the batch that starts the next run ready, it asks for the next slot in its turn
        right away (``Slots.give``)."""
        if self._scheduler is None:
            return
        next_job, next_samples = None, 0
        if retry is not None:
            batch = retry[0] if retry else self._pick(_any_batch, pop=False)
            if batch is not None and batch.member is not None:
                next_job, next_samples = batch.member.job_id, batch.size
        self.slots.give(count, next_job, next_samples)

    def give_up(self, last: bool = True) -> None:
        """Gives back every slot the calling instance holds or keeps; ``last``: the pipeline
        stops (no instance of it goes on), so every slot kept for its jobs goes back too."""
        jobs = {member.job_id for member in list(self.members)} if last else None
        self.slots.give_up(jobs)


class _Looks(threading.local):
    """What the calling instance's last look for a batch found: whether a member's batch was
    refused for a while only (its memory full, its copies not due yet), so that it looks again
    soon."""

    def __init__(self) -> None:
        self.starved = False
