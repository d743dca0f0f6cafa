"""Each cohort member's window (docs/design/cohort-outputs.md, "A member's window"): whether a
batch served from another member's run may be given now, and the batches parked on an entry
until their job's window has room. Not locked: its cohort calls it under the cohort's lock."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from .job_window import TRAINER_HOLDS

if TYPE_CHECKING:
    from .cohort_entries import Entry
    from .runs import Member, PendingBatch


class Admission(enum.Enum):
    """What a member's window lets a batch served from the cohort do."""

    SERVE = "serve"  # given now: a lease of the entry's regions
    PARK = "park"  # parked on the entry until the window has room
    # Past the window even for the batch the trainer waits for (a trainer that keeps its
    # outputs): served as a private copy, or run for its job alone.
    KEEPER = "keeper"


class MemberWindows:
    """Per member, the batch its trainer waits for and its parked batches (oldest first)."""

    def __init__(self) -> None:
        self._parked: dict[int, dict[int, tuple[PendingBatch, Entry]]] = {}
        self._wanted: dict[int, int] = {}

    def join(self, job_id: int) -> None:
        self._parked.setdefault(job_id, {})

    def leave(self, job_id: int) -> None:
        """Forgets the member: its parked batches are dropped."""
        self._wanted.pop(job_id, None)
        for _, entry in self._parked.pop(job_id, {}).values():
            entry.parked -= 1

    def admit(self, member: Member, batch_id: int, counted: int) -> Admission:
        """Whether ``member`` may be served one more batch now, as the planner's window goes
        (Note [A job's window]), counting its own runs and ``counted`` batches it holds from
        the cohort."""
        window = member.executor.window if member.executor is not None else 0
        held = member.held + counted
        if not window or held < window:
            return Admission.SERVE
        if batch_id != self._wanted.get(member.job_id):
            return Admission.PARK
        if held < window + TRAINER_HOLDS + 1:
            return Admission.SERVE
        return Admission.KEEPER  # a trainer that keeps its outputs: the run path bounds it

    def park(self, batch: PendingBatch, entry: Entry) -> None:
        member = batch.member
        assert member is not None
        self._parked[member.job_id][batch.batch_id] = (batch, entry)
        entry.parked += 1

    def want(self, job_id: int, batch_id: int) -> tuple[PendingBatch, Entry] | None:
        """The trainer of ``job_id`` waits for ``batch_id``: taken off its parking if parked."""
        self._wanted[job_id] = batch_id
        return self._unpark(job_id, batch_id)

    def oldest(self, job_id: int) -> tuple[int, PendingBatch, Entry] | None:
        """``job_id``'s oldest parked batch, left parked."""
        parked = self._parked.get(job_id)
        if not parked:
            return None
        batch_id, (batch, entry) = next(iter(parked.items()))
        return batch_id, batch, entry

    def _unpark(self, job_id: int, batch_id: int) -> tuple[PendingBatch, Entry] | None:
        parked = self._parked.get(job_id, {}).pop(batch_id, None)
        if parked is not None:
            parked[1].parked -= 1
        return parked

    def unpark(self, job_id: int, batch_id: int) -> tuple[PendingBatch, Entry] | None:
        """Takes ``job_id``'s batch ``batch_id`` off its parking, to be served."""
        return self._unpark(job_id, batch_id)

    def sender_left(self, job_id: int, first_id: int, end_id: int) -> None:
        """The parked batches ``first_id <= id < end_id`` of ``job_id`` are dropped: nobody
        will ask for them (their worker left)."""
        parked = self._parked.get(job_id, {})
        for batch_id in [i for i in parked if first_id <= i < end_id]:
            _, entry = parked.pop(batch_id)
            entry.parked -= 1

    def drop_parked_on(self, entry: Entry) -> list[PendingBatch]:
        """``entry`` left the cache before the batches parked on it had room: each runs for
        its own job."""
        if not entry.parked:
            return []
        dropped = []
        for parked in self._parked.values():
            for batch_id in [i for i, (_, e) in parked.items() if e is entry]:
                dropped.append(parked.pop(batch_id)[0])
        entry.parked = 0
        return dropped
