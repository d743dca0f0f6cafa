"""What a cohort does under its lock (docs/design/cohort-outputs.md): matches a member's batch
against the entries, gives an entry's outputs to the members that wait for it, as leases, parked
batches or private copies, and ends leases; it orders its parts (the cache, the leases, the
members' windows, the charges and the figures) and leaves what must happen outside the lock in
its outbox. Not locked itself, and touching no thread: ``cohorts.Cohort`` holds the lock and
does the outbox's work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dalid.protocol import BatchReady, CohortStatus, OutputDescriptor

from ..outputs.job_outputs import JobOutputs
from .cohort_cache import CohortCache
from .cohort_charges import Charged
from .cohort_entries import Entry, EntryRuns, EntryState, Outcome, Settle
from .cohort_figures import CohortFigures
from .cohort_leases import Alive, CohortLeases, Lease
from .cohort_matching import same_inputs
from .cohort_windows import Admission, MemberWindows

if TYPE_CHECKING:
    from .runs import Member, PendingBatch


@dataclass
class Outbox:
    """What the lock's holders leave to do outside it (``Cohort._flush``)."""

    charges: list[Charged] = field(default_factory=list)
    answers: list[tuple[PendingBatch, BatchReady]] = field(default_factory=list)
    copies: list[tuple[PendingBatch, Entry]] = field(default_factory=list)  # private copies
    runs: list[PendingBatch] = field(default_factory=list)  # batches to run for their own job
    ranks: list[tuple[int, bool]] = field(default_factory=list)


class CohortState:
    """A cohort's members, entries and parts, for ``cohort`` (whose runs its entries are).
    Every method is called under the cohort's lock."""

    def __init__(
        self, cohort: EntryRuns, name: str, outputs: JobOutputs, window_bytes: int, alive: Alive
    ) -> None:
        self._cohort = cohort
        self._alive = alive
        self.cache = CohortCache(outputs, window_bytes)
        self.leases = CohortLeases(outputs)
        self.windows = MemberWindows()
        self.figures = CohortFigures(name)
        self.outbox = Outbox()
        self.members: dict[int, Member] = {}
        self.closed = False

    @property
    def window_bytes(self) -> int:
        return self.cache.window_bytes

    def take_outbox(self) -> Outbox:
        outbox, self.outbox = self.outbox, Outbox()
        return outbox

    # --- members --------------------------------------------------------------------------------

    def join(self, member: Member) -> None:
        self.members[member.job_id] = member
        self.figures.join(member.job_id)
        self.leases.join(member.job_id)
        self.windows.join(member.job_id)

    def leave(self, member: Member, pid: int, namespace: int, stopped: bool) -> list[PendingBatch]:
        """``member``'s job ended: its followers and queued runs pass to other members (the
        batches to run again), its leases end now or with its trainer process. ``stopped``:
        its pipeline stopped with it, dropping the runs it held."""
        resubmit: list[PendingBatch] = []
        job_id = member.job_id
        self.members.pop(job_id, None)
        self.figures.leave(job_id)
        self.windows.leave(job_id)
        for entry in self.cache.pending():
            entry.followers = [f for f in entry.followers if f.member is not member]
            producer = entry.producer
            if (
                producer is not None
                and producer.member is member
                and (stopped or not producer.held)
            ):
                # Dropped with its job: a follower runs it instead.
                if entry.followers:
                    entry.producer = entry.followers.pop(0)
                    entry.producer.cohort_entry = entry
                    resubmit.append(entry.producer)
                else:
                    entry.producer = None
                    self.cache.drop(entry)
        for lease in self.leases.leave(job_id, pid, namespace, self._alive):
            self._lease_ended(lease)
        self.leases.unmap_gone(job_id, pid, namespace, self._alive)
        self._uncache_served()
        return resubmit

    def reap(self) -> None:
        """Ends the leases of members gone whose trainer process has exited since, and lets
        the cohort's GPU slabs they mapped go."""
        for lease in self.leases.reap(self._alive):
            self._lease_ended(lease)
        self.leases.reap_mappings(self._alive)

    def take(
        self, batch: PendingBatch, member: Member, digest: bytes
    ) -> tuple[Outcome, BatchReady | None]:
        """``Cohort.take``: the outcome, and the result of a batch served now."""
        request = batch.request
        for entry in self.cache.matching(digest):
            if member.job_id in entry.served or entry.state is EntryState.GONE:
                continue  # a job never gets its own outputs again (a second epoch, say)
            if entry.state is EntryState.READY and not entry.cached:
                continue
            if not same_inputs(entry.inputs, request.inputs, entry.unreadable, request.unreadable):
                continue
            if entry.state is EntryState.READY and entry.on_gpu and not _maps_gpu(member):
                # It cannot map the cohort's GPU memory: it runs them for itself, and the
                # outputs wait for it no longer.
                entry.served.add(member.job_id)
                self._uncache_served()
                return Outcome.ALONE, None
            entry.served.add(member.job_id)
            self._rank(member.job_id, behind=False)
            if entry.state is EntryState.PENDING:
                entry.followers.append(batch)
                return Outcome.FOLLOW, None
            admission = self._admit(member, batch.batch_id)
            if admission is Admission.PARK:
                self.windows.park(batch, entry)
                return Outcome.PARKED, None
            if admission is Admission.KEEPER:
                if not self._copy(batch, entry):
                    return Outcome.ALONE, None
                self._uncache_served()
                return Outcome.HIT, None  # answered by ``_flush``, with its copies
            self.figures.hits += 1
            ready = self._ready(batch, entry, self._lease(entry, member.job_id, None, batch))
            self._uncache_served()
            return Outcome.HIT, ready
        behind = self.cache.trails(digest, member.job_id)
        self._rank(member.job_id, behind)
        if behind:
            self.figures.behind_runs += 1
        if member.overflow:
            # Its trainer keeps its outputs (Note [A job's window]): its runs go to its own
            # memory, as private copies once that is full, not to the cohort's.
            return Outcome.ALONE, None
        entry = Entry(
            self._cohort, digest, tuple(request.inputs), tuple(request.unreadable), batch,
            served={member.job_id},
        )  # fmt: skip
        self.cache.add(entry)
        batch.cohort_entry = entry
        return Outcome.RUN, None

    # --- runs ---------------------------------------------------------------------------------

    def evict_oldest(self) -> bool:
        """Drops the oldest cached outputs no member holds, to make room; whether any went."""
        evicted = self.cache.evict_oldest(self.members)
        if evicted is None:
            return False
        self._uncached([evicted])
        return True

    def account(self, entry: Entry, seconds: float) -> None:
        """Charges ``seconds`` of service, the run of ``entry``, to its producer; the members
        given its outputs later take their share (``_give_share``)."""
        payers = entry.payers()
        if payers:
            # The producer's slot paid the run's tag. Its share goes to each follower only as
            # that one is given the outputs: a follower that leaves first, or runs alone past
            # its window, pays for its own run alone.
            self.outbox.charges += entry.charge.produced(payers[0], seconds)

    def publish(
        self, entry: Entry, descriptors: tuple[OutputDescriptor, ...], settle: Settle
    ) -> list[tuple[PendingBatch, BatchReady | None]]:
        """The run of ``entry`` is in the cohort's memory: the results for its producer (whose
        window ``settle`` frees once its trainer released them) and its followers; None for
        one whose trainer cannot map the cohort's GPU memory, to be written into its own
        memory from the run."""
        results: list[tuple[PendingBatch, BatchReady | None]] = []
        self.cache.ready(entry, descriptors)
        recipients = entry.recipients()
        entry.followers = []
        self.figures.runs += 1
        private = False
        for batch in recipients:
            member = batch.member
            assert member is not None
            if member.closed or member.job_id not in self.members:
                continue
            if entry.on_gpu and not _maps_gpu(member):
                # Its own copy, from the run (as ``take_recipients``): outside the cohort's
                # memory, so outside its window here; its own memory bounds it.
                self._give_share(entry, member.job_id)
                self.figures.served_one(member.job_id)
                self.figures.hits += batch is not entry.producer
                results.append((batch, None))
                private = True
                continue
            if batch is entry.producer:
                leased = self._lease(entry, member.job_id, settle, batch)
                results.append((batch, self._ready(batch, entry, leased)))
                continue
            # A hit once it is served (a parked one, by ``_serve_parked`` when it is).
            admission = self._admit(member, batch.batch_id)
            if admission is Admission.PARK:
                self.windows.park(batch, entry)
            elif admission is Admission.KEEPER:
                if not self._copy(batch, entry):
                    self.outbox.runs.append(batch)
            else:
                self.figures.hits += 1
                leased = self._lease(entry, member.job_id, None, batch)
                results.append((batch, self._ready(batch, entry, leased)))
        self.figures.copied += private
        self.cache.keep(entry)
        self._uncache_served()
        self.cache.free_if_done(entry)
        for batch, ready in results:
            if ready is None:
                batch.cohort_entry = None
        return results

    def take_recipients(self, entry: Entry) -> list[PendingBatch]:
        """The run of ``entry`` cannot go to the cohort's memory: its producer and followers,
        each to be written into its own memory from the run."""
        recipients = entry.recipients()
        entry.followers = []
        for batch in recipients:
            member = batch.member
            if member is None or member.closed or member.job_id not in self.members:
                continue  # gone: no copy is written for it, so it takes no share
            self._give_share(entry, member.job_id)
        self.figures.copied += 1
        self.figures.runs += 1
        self.figures.hits += len(recipients) - 1
        self.cache.drop(entry)
        for batch in recipients:
            batch.cohort_entry = None
        return recipients

    def abandon(self, entry: Entry) -> list[PendingBatch]:
        """The run of ``entry`` failed or had bad samples: nothing of it is shared; its
        followers, to run for themselves."""
        followers, entry.followers = entry.followers, []
        self.cache.drop(entry)
        for batch in followers:
            batch.cohort_entry = None
        return followers

    # --- releases, wants --------------------------------------------------------------------

    def release(
        self, job_id: int, region_ids: Sequence[int], fence: str, closed_slabs: Sequence[str]
    ) -> tuple[list[int], list[Settle]]:
        """Ends ``job_id``'s leases of these region ids (``Cohort.release``): the ids not
        leased, and what frees the producers' windows, to call outside the lock before
        ``released``."""
        settled: list[Settle] = []
        unknown, done = self.leases.release(job_id, region_ids, fence, closed_slabs)
        for lease in done:
            settle = self._lease_ended(lease)
            if settle is not None:
                settled.append(settle)
        return unknown, settled

    def released(self, job_id: int) -> None:
        """``job_id``'s window has room again: its parked batches are served."""
        self._serve_parked(job_id)
        self._uncache_served()

    def want(self, job_id: int, batch_id: int) -> None:
        """The trainer of ``job_id`` waits for ``batch_id``: parked, it passes the job's full
        window, or runs for its job alone (docs/design/cohort-outputs.md)."""
        parked = self.windows.want(job_id, batch_id)
        member = self.members.get(job_id)
        if parked is not None and member is not None:
            batch, entry = parked
            if self._admit(member, batch_id) is Admission.SERVE:
                self._give_parked(batch, entry)
            elif not self._copy(batch, entry):
                self.outbox.runs.append(batch)
            self._uncache_served()

    def sender_left(self, job_id: int, first_id: int, end_id: int) -> None:
        """The worker that sent ``job_id``'s batches ``first_id <= id < end_id`` left: its
        leases stop counting in the job's window, its parked batches are dropped (nobody will
        ask for them: Note [A job's window])."""
        self.leases.sender_left(job_id, first_id, end_id)
        self.windows.sender_left(job_id, first_id, end_id)
        self._serve_parked(job_id)
        self._uncache_served()

    def status(self) -> CohortStatus:
        entries = {id(e): e for e in self.leases.entries()}
        entries.update((id(e), e) for e in self.cache.entries())
        return self.figures.status(
            tuple(sorted(self.members)),
            held_bytes=self.cache.held_bytes(),
            leased_bytes=sum(e.nbytes for e in entries.values() if e.leases),
            window_bytes=self.window_bytes,
            dropped=self.cache.dropped,
            device_bytes=self.leases.device_bytes,
        )

    def copied(self, entry: Entry) -> None:
        """The copies ``_copy`` promised were read: its pin of ``entry`` ends."""
        self.leases.unpin(entry)
        self.cache.free_if_done(entry)
        self._uncached(self.cache.fit_window(self.members))

    def clear(self) -> None:
        """The cohort closes: nothing more is matched, leased or kept."""
        self.closed = True
        self.cache.clear()
        self.leases.clear()

    # --- under the lock -------------------------------------------------------------------------

    def _lease(
        self, entry: Entry, job_id: int, settle: Settle | None, batch: PendingBatch
    ) -> tuple[OutputDescriptor, ...]:
        """Leases ``entry``'s regions to ``job_id``, which takes its share of the run."""
        descriptors = self.leases.lease(entry, job_id, settle, batch.batch_id)
        self._give_share(entry, job_id)
        self.figures.served_one(job_id)
        return descriptors

    def _lease_ended(self, lease: Lease) -> Settle | None:
        settle = self.leases.end(lease)
        self.cache.free_if_done(lease.entry)
        self._uncached(self.cache.fit_window(self.members))
        return settle

    def _ready(
        self, batch: PendingBatch, entry: Entry, descriptors: tuple[OutputDescriptor, ...]
    ) -> BatchReady:
        member = batch.member
        assert member is not None
        return BatchReady(
            batch.batch_id,
            member.pipeline_id,
            descriptors,
            retired_slabs=self.leases.take_retired(member.job_id),
            event=entry.event if entry.on_gpu else "",
        )

    def _uncache_served(self) -> None:
        self._uncached(self.cache.uncache_served(self.members))

    def _uncached(self, entries: list[Entry]) -> None:
        """Entries that left the cache: batches parked on them run for their own jobs."""
        for entry in entries:
            self.outbox.runs += self.windows.drop_parked_on(entry)

    def _give_share(self, entry: Entry, job_id: int) -> None:
        self.outbox.charges += entry.charge.share(job_id)

    def _admit(self, member: Member, batch_id: int) -> Admission:
        return self.windows.admit(member, batch_id, self.leases.counted(member.job_id))

    def _serve_parked(self, job_id: int) -> None:
        """Serves ``job_id``'s parked batches, oldest first, while its window has room."""
        member = self.members.get(job_id)
        while member is not None:
            oldest = self.windows.oldest(job_id)
            if oldest is None:
                return
            batch_id, batch, entry = oldest
            if self._admit(member, batch_id) is not Admission.SERVE:
                return
            self.windows.unpark(job_id, batch_id)
            self._give_parked(batch, entry)

    def _give_parked(self, batch: PendingBatch, entry: Entry) -> None:
        """A parked batch, served from ``entry`` now (answered by ``_flush``)."""
        member = batch.member
        assert member is not None
        self.figures.hits += 1
        descriptors = self._lease(entry, member.job_id, None, batch)
        self.outbox.answers.append((batch, self._ready(batch, entry, descriptors)))

    def _copy(self, batch: PendingBatch, entry: Entry) -> bool:
        """A batch past its member's window, served from ``entry`` as private copies rather
        than run again, where its trainer takes copies; whether it will be. The entry stays
        pinned until ``_flush`` has copied its bytes."""
        member = batch.member
        assert member is not None
        if member.outputs.copy_after is None or entry.state is not EntryState.READY:
            return False  # a trainer that takes no copies: its run waits for its memory
        self.figures.hits += 1
        self.figures.served_one(member.job_id)
        self._give_share(entry, member.job_id)
        self.leases.pin(entry)
        self.outbox.copies.append((batch, entry))
        return True

    def _rank(self, job_id: int, behind: bool) -> None:
        """``job_id`` is behind the window now, or not: told to the scheduler by ``_flush``, on
        a change only."""
        if self.figures.rank(job_id, behind):
            self.outbox.ranks.append((job_id, behind))


def _maps_gpu(member: Member) -> bool:
    """Whether ``member``'s trainer maps GPU memory by CUDA IPC (else its GPU outputs are
    staged: ``cuda_staged.py``), so may be given the cohort's GPU regions."""
    return any(store.device == "cuda" for store in member.outputs.stores)
