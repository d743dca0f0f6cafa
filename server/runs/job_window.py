"""How many of a job's batches the daemon holds at once, and which may be taken into a run
(Note [A job's window]).

Note [A job's window]
---------------------
A member holds at most ``window`` batches (``Member.holding``), from the moment one is taken
into a run until it is answered without a lease or its trainer released every region of it:
the pipeline's prefetch for each DALI instance, plus ``TRAINER_HOLDS``, and no wider than its
job's output memory holds beside the two batches the trainer holds and waits for. The batch
the trainer waits for (``want_batch``) goes first and passes a full window by
``TRAINER_HOLDS + 1``; a trainer that keeps its outputs overflows it after ``copy_after``,
until it releases a batch. A worker that leaves takes its batches out of the window. Why and
the tests: docs/design/job-window.md.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from dalid.protocol import BATCH_IDS_PER_CONNECTION

from .runs import SENDERS_REMEMBERED, Member, PendingBatch

# The batch a trainer holds while it waits for its next one.
TRAINER_HOLDS = 1


class Take(enum.Enum):
    """Whether a member's next batch may be taken into a run now."""

    YES = "yes"
    NO = "no"  # until a release, a want or a run changes something
    NOT_YET = "not yet"  # it waits out ``copy_after``: look again soon


class JobWindow:
    """The window of each member of one pipeline: ``window`` batches (0: no limit), narrowed
    to what the member's output memory holds at ``sample_sizes`` (each output's device and
    bytes per sample, from the pipeline's last run). It changes the members' window fields
    (``holding``, ``wanted``, ``overflow``, ...): ``want``, ``settle``, ``sender_left`` and
    ``hold`` under the planner's ``changed``, which guards them; ``check`` and ``room`` are the
    planner's looks, made without it (a batch a stale look passes over waits for the next)."""

    def __init__(self) -> None:
        self.window = 0
        self.sample_sizes: list[tuple[str, int]] = []

    def want(self, member: Member, batch_id: int) -> None:
        """``member``'s trainer waits for ``batch_id``: one integer, replaced by the next."""
        member.wanted = batch_id
        member.want_blocked_since = None

    @staticmethod
    def settle(batch: PendingBatch, released: bool) -> bool:
        """``batch`` leaves its job's window: answered without a lease, or (``released``) its
        trainer released its regions, which also ends the member's overflow; whether it was
        in the window."""
        member = batch.member
        assert member is not None
        if not batch.held:
            return False
        batch.held = False
        member.holding.pop(batch.batch_id, None)
        if released:
            member.overflow = False
        return True

    @staticmethod
    def sender_left(member: Member, first_id: int, end_id: int) -> bool:
        """The worker that sent ``member``'s batches ``first_id <= id < end_id`` left: those
        held leave its window, and those still to run will not count in it; whether any
        left."""
        member.senders_left[first_id // BATCH_IDS_PER_CONNECTION] = None
        if len(member.senders_left) > SENDERS_REMEMBERED:
            del member.senders_left[next(iter(member.senders_left))]
        gone = [b for i, b in member.holding.items() if first_id <= i < end_id]
        for batch in gone:
            batch.held = False
            del member.holding[batch.batch_id]
        return bool(gone)

    @staticmethod
    def hold(batch: PendingBatch) -> None:
        """Counts a batch just taken off its queue into its member's window."""
        member = batch.member
        assert member is not None
        if batch.batch_id == member.wanted:
            member.wanted = None
            member.want_blocked_since = None
        if batch.batch_id // BATCH_IDS_PER_CONNECTION in member.senders_left:
            return  # its worker left: nobody may ask for it
        batch.held = True
        member.holding[batch.batch_id] = batch

    def check(self, member: Member, head: PendingBatch) -> Take:
        """Whether ``member``'s queue head may be taken now, as far as its window goes."""
        if not self.window or not member.held or member.overflow:
            return Take.YES
        window = self.width(member, head)
        if member.held < window:
            return Take.YES
        if head.batch_id != member.wanted:
            return Take.NO
        if member.held < window + TRAINER_HOLDS + 1:
            return Take.YES  # what the trainer waits for passes a full window
        copy_after = member.outputs.copy_after
        if copy_after is None:
            return Take.NO  # a trainer that takes no copies waits for its releases
        now = time.monotonic()
        if member.want_blocked_since is None:
            member.want_blocked_since = now
        if now - member.want_blocked_since >= copy_after:
            member.overflow = True  # it keeps its outputs
            return Take.YES
        return Take.NOT_YET

    def width(self, member: Member, head: PendingBatch) -> int:
        """``member``'s window: the pipeline's, no wider than its job's output memory holds
        beside the batch its trainer holds and the one it waits for."""
        if not self.sample_sizes:
            return 1  # the outputs' sizes are known once a run is out
        fits = member.outputs.batches_fit(self.sizes(head))
        return max(1, min(self.window, fits - TRAINER_HOLDS - 1))

    def room(self, member: Member, head: PendingBatch) -> Take:
        """Whether ``member``'s job's output memory has room for ``head`` (on a pipeline other
        jobs share: a job whose trainer holds all its buffers waits for them, and must not stop
        the pipeline while it does). A trainer that takes private copies gets them once it has
        held everything for ``copy_after`` (Note [Private copies] in copies.py)."""
        if not self.sample_sizes:
            return Take.YES
        if member.outputs.has_room(self.sizes(head)):
            member.starved_since = None
            return Take.YES
        copy_after = member.outputs.copy_after
        now = time.monotonic()
        if member.starved_since is None:
            member.starved_since = now
        if copy_after is not None and now - member.starved_since >= copy_after:
            return Take.YES
        return Take.NOT_YET

    def sizes(self, head: PendingBatch) -> Sequence[tuple[str, int]]:
        """Each output's device and bytes for a batch of ``head``'s size."""
        return [(device, size * head.size) for device, size in self.sample_sizes]
