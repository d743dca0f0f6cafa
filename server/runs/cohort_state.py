"""Cohorts: jobs that read the same data through the same pipeline pay for its preprocessing once.

A job joins a cohort by name when it registers a pipeline; every member must register the same
graph. A batch a member submits is matched by its inputs' content against the batches of the
other members: a cheap digest finds a candidate, an exact comparison of the bytes decides. A
batch that matches nothing becomes an *entry* and runs (for its job, and for whoever submits the
same inputs meanwhile); one that matches an entry is served its outputs without a run.

Note [Cohort outputs]
---------------------
A run of an entry is written once, into the cohort's memory, and every member served it maps
the same regions under lease ids of its own; a region is written again only once no member
leases it and the entry has left the cache, which keeps a ready entry for members not served
yet within ``window_bytes``. A run is charged once, split among the members that consumed it.
Batches served from others' runs count in the member's window (Note [A job's window]): past
it they wait parked, then come as private copies or run alone. A member whose inputs left the
cache unserved is behind, and ranks so. The whole contract, why and the tests:
docs/design/cohort-outputs.md.

Here the cohort matches batches and orders its parts under its one lock: the cache of shared
runs (``cohort_cache.py``), leases and the GPU slabs members map (``cohort_leases.py``), each
member's window (``cohort_windows.py``) and the split of a run's charge (``cohort_charges.py``).
The daemon's cohorts by name, and who may join one, are ``cohort_registry.py``; how batches are
compared, ``cohort_matching.py``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dalid.protocol import BatchFailed, BatchReady, CohortStatus, ErrorCode, OutputDescriptor

from ..outputs.outputs import JobOutputs, OutputFailure, RunOutput
from ..outputs.pool import PoolClosed, PoolFull
from .cohort_cache import CohortCache
from .cohort_charges import Charge, Charged, no_charge
from .cohort_entries import Entry, EntryState, Outcome, Settle
from .cohort_figures import CohortFigures
from .cohort_leases import COHORT_REGION_BASE, Alive, CohortLeases, Lease
from .cohort_matching import batch_digest, same_inputs
from .cohort_windows import Admission, MemberWindows

if TYPE_CHECKING:
    from .runs import Member, PendingBatch

__all__ = ["COHORT_REGION_BASE", "Cohort", "Entry", "Outcome", "no_charge", "no_rank", "resubmit"]

log = logging.getLogger("dalid.server")

# rank(job_id, behind): a member fell past the window, or is back (FairScheduler.set_behind).
Rank = Callable[[int, bool], None]


def no_rank(job_id: int, behind: bool) -> None:
    pass


@dataclass
class _Outbox:
    """What the lock's holders leave to do outside it (``Cohort._flush``)."""

    charges: list[Charged] = field(default_factory=list)
    answers: list[tuple[PendingBatch, BatchReady]] = field(default_factory=list)
    copies: list[tuple[PendingBatch, Entry]] = field(default_factory=list)  # private copies
    runs: list[PendingBatch] = field(default_factory=list)  # batches to run for their own job
    ranks: list[tuple[int, bool]] = field(default_factory=list)


class Cohort:
    """The members of one cohort, its entries and the memory their outputs live in.

    Thread-safe: the I/O thread submits, releases and removes members; executor threads write
    and publish runs; its parts are called under its one lock. ``outputs``: the cohort's own
    output memory; ``window_bytes``: the most bytes of outputs held for trailing members only;
    ``alive`` tells whether a trainer process lives (pid, pid namespace); ``charge`` counts a
    share of a run to a job, ``share`` moves its fair-share tag too, ``behind`` ranks a member
    past the window (docs/design/cohort-outputs.md).
    """

    def __init__(
        self,
        name: str,
        key: Hashable,
        outputs: JobOutputs,
        window_bytes: int,
        alive: Alive,
        *,
        charge: Charge = no_charge,
        share: Charge = no_charge,
        behind: Rank = no_rank,
    ) -> None:
        self.name = name
        self.key = key
        self.outputs = outputs
        self._alive = alive
        self._charge = charge
        self._share = share
        self._behind = behind
        self._lock = threading.Lock()
        self._cache = CohortCache(outputs, window_bytes)
        self._leases = CohortLeases(outputs)
        self._windows = MemberWindows()
        self._outbox = _Outbox()
        self._figures = CohortFigures(name)
        self.members: dict[int, Member] = {}
        self._closed = False

    @property
    def window_bytes(self) -> int:
        return self._cache.window_bytes

    # --- members --------------------------------------------------------------------------------

    def join(self, member: Member) -> None:
        with self._lock:
            self.members[member.job_id] = member
            self._figures.join(member.job_id)
            self._leases.join(member.job_id)
            self._windows.join(member.job_id)
        member.cohort = self

    def leave(self, member: Member, pid: int, namespace: int) -> None:
        """``member``'s job ended (its executor has let it go): its followers and queued runs
        pass to other members, its leases end now or with its trainer process."""
        resubmit: list[PendingBatch] = []
        # A pipeline of the job's own stopped with it, dropping the runs it held; a shared one
        # still delivers those it took (the others see them published).
        stopped = member.executor is None or not member.executor.members
        with self._lock:
            job_id = member.job_id
            self.members.pop(job_id, None)
            self._figures.leave(job_id)
            self._windows.leave(job_id)
            for entry in self._cache.pending():
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
                        self._cache.drop(entry)
            for lease in self._leases.leave(job_id, pid, namespace, self._alive):
                self._lease_ended(lease)
            self._leases.unmap_gone(job_id, pid, namespace, self._alive)
            self._uncache_served()
        for batch in resubmit:
            _resubmit(batch)
        self._flush()

    def reap(self) -> None:
        """Ends the leases of members gone whose trainer process has exited since, and lets
        the cohort's GPU slabs they mapped go."""
        with self._lock:
            for lease in self._leases.reap(self._alive):
                self._lease_ended(lease)
            self._leases.reap_mappings(self._alive)

    def peer_leaving(self, job_id: int, kept_slabs: Sequence[str]) -> None:
        """The trainer of member ``job_id`` said goodbye: it maps ``kept_slabs`` still, and no
        other slab of the cohort's GPU memory (Note [GPU output lifetime] in cuda.py)."""
        self._leases.peer_leaving(job_id, kept_slabs)

    @property
    def awaiting_peers(self) -> bool:
        """Whether GPU slabs of the closed cohort wait for members' processes to unmap them."""
        return self._leases.awaiting_peers

    @property
    def empty(self) -> bool:
        return not self.members

    # --- submissions ----------------------------------------------------------------------------

    def take(self, batch: PendingBatch) -> tuple[Outcome, BatchReady | None]:
        """Matches a member's submitted batch: served now from the cache (HIT, with its
        result), waiting for another member's run (FOLLOW: answered when it ends) or for room
        in its job's window (PARKED: answered then, or run alone), or to run (RUN:
        ``batch.cohort_entry`` is its entry; ALONE: for its job only)."""
        member = batch.member
        assert member is not None
        request = batch.request
        digest = batch_digest(request.inputs, request.unreadable)
        with self._lock:
            taken = self._take(batch, member, digest)
        self._flush()
        return taken

    def _take(
        self, batch: PendingBatch, member: Member, digest: bytes
    ) -> tuple[Outcome, BatchReady | None]:
        """``take``, under the lock."""
        request = batch.request
        for entry in self._cache.matching(digest):
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
                self._windows.park(batch, entry)
                return Outcome.PARKED, None
            if admission is Admission.KEEPER:
                if not self._copy(batch, entry):
                    return Outcome.ALONE, None
                self._uncache_served()
                return Outcome.HIT, None  # answered by ``_flush``, with its copies
            self._figures.hits += 1
            ready = self._ready(batch, entry, self._lease(entry, member.job_id, None, batch))
            self._uncache_served()
            return Outcome.HIT, ready
        behind = self._cache.trails(digest, member.job_id)
        self._rank(member.job_id, behind)
        if behind:
            self._figures.behind_runs += 1
        if member.overflow:
            # Its trainer keeps its outputs (Note [A job's window]): its runs go to its own
            # memory, as private copies once that is full, not to the cohort's.
            return Outcome.ALONE, None
        entry = Entry(
            self, digest, tuple(request.inputs), tuple(request.unreadable), batch,
            served={member.job_id},
        )  # fmt: skip
        self._cache.add(entry)
        batch.cohort_entry = entry
        return Outcome.RUN, None

    # --- runs (executor threads) ----------------------------------------------------------------

    def write(
        self,
        outputs: Sequence[RunOutput],
        rows: range,
        source_stream: int | None,
        entry: Entry | None = None,
    ) -> tuple[OutputDescriptor, ...] | None:
        """Copies an entry's rows of a run into the cohort's memory (the run's batch event, for
        GPU outputs, goes to ``entry``); None where they cannot go there (they are then copied
        into each member's own memory)."""
        takes = {store.takes for store in self.outputs.stores}
        kinds = {"cuda" if _on_gpu(output) else "cpu" for output in outputs}
        if not kinds <= takes:
            return None
        while True:
            try:
                descriptors, event = self.outputs.write_batch(
                    outputs, rows, source_stream=source_stream, wait=False
                )
                if entry is not None:
                    entry.event = event
                return descriptors
            except PoolFull:
                with self._lock:
                    evicted = self._cache.evict_oldest(self.members)
                    if evicted is not None:
                        self._uncached([evicted])
                self._flush()  # batches parked on what went run for their own jobs
                if evicted is None:
                    return None
            except (OutputFailure, PoolClosed):
                return None

    def account(self, entry: Entry, seconds: float) -> None:
        """Charges ``seconds`` of service, the run of ``entry``, to its producer; the members
        given its outputs later take their share (``_give_share``)."""
        with self._lock:
            payers = entry.payers()
            if payers:
                # The producer's slot paid the run's tag. Its share goes to each follower only
                # as that one is given the outputs: a follower that leaves first, or runs alone
                # past its window, pays for its own run alone.
                self._outbox.charges += entry.charge.produced(payers[0], seconds)
        self._flush()

    def publish(
        self, entry: Entry, descriptors: tuple[OutputDescriptor, ...], settle: Settle
    ) -> list[tuple[PendingBatch, BatchReady | None]]:
        """The run of ``entry`` is in the cohort's memory: the results for its producer (whose
        window ``settle`` frees once its trainer released them) and its followers; None for
        one whose trainer cannot map the cohort's GPU memory, to be written into its own
        memory from the run."""
        results: list[tuple[PendingBatch, BatchReady | None]] = []
        with self._lock:
            self._cache.ready(entry, descriptors)
            recipients = entry.recipients()
            entry.followers = []
            self._figures.runs += 1
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
                    self._figures.served_one(member.job_id)
                    self._figures.hits += batch is not entry.producer
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
                    self._windows.park(batch, entry)
                elif admission is Admission.KEEPER:
                    if not self._copy(batch, entry):
                        self._outbox.runs.append(batch)
                else:
                    self._figures.hits += 1
                    leased = self._lease(entry, member.job_id, None, batch)
                    results.append((batch, self._ready(batch, entry, leased)))
            self._figures.copied += private
            self._cache.keep(entry)
            self._uncache_served()
            self._cache.free_if_done(entry)
        for batch, ready in results:
            if ready is None:
                batch.cohort_entry = None
        self._flush()
        return results

    def take_recipients(self, entry: Entry) -> list[PendingBatch]:
        """The run of ``entry`` cannot go to the cohort's memory: its producer and followers,
        each to be written into its own memory from the run."""
        with self._lock:
            recipients = entry.recipients()
            entry.followers = []
            for batch in recipients:
                member = batch.member
                if member is None or member.closed or member.job_id not in self.members:
                    continue  # gone: no copy is written for it, so it takes no share
                self._give_share(entry, member.job_id)
            self._figures.copied += 1
            self._figures.runs += 1
            self._figures.hits += len(recipients) - 1
            self._cache.drop(entry)
        for batch in recipients:
            batch.cohort_entry = None
        self._flush()
        return recipients

    def abandon(self, entry: Entry) -> list[PendingBatch]:
        """The run of ``entry`` failed or had bad samples: nothing of it is shared; its
        followers, to run for themselves."""
        with self._lock:
            followers, entry.followers = entry.followers, []
            self._cache.drop(entry)
        for batch in followers:
            batch.cohort_entry = None
        return followers

    # --- releases (the I/O thread) --------------------------------------------------------------

    def release(
        self,
        job_id: int,
        region_ids: Sequence[int],
        fence: str = "",
        closed_slabs: Sequence[str] = (),
    ) -> list[int]:
        """Ends ``job_id``'s leases of these cohort region ids, after its trainer's release
        ``fence`` (hex; for GPU regions), and notes the cohort's GPU slabs it reports unmapped;
        returns the ids not leased. Raises ReleaseRefused for a fence that cannot be used."""
        settled: list[Settle] = []
        with self._lock:
            unknown, done = self._leases.release(job_id, region_ids, fence, closed_slabs)
            for lease in done:
                settle = self._lease_ended(lease)
                if settle is not None:
                    settled.append(settle)
        for settle in settled:
            settle()
        with self._lock:
            self._serve_parked(job_id)  # its window has room again (after the settles above)
            self._uncache_served()
        self._flush()
        return unknown

    def want(self, job_id: int, batch_id: int) -> None:
        """The trainer of ``job_id`` waits for ``batch_id``: parked, it passes the job's full
        window, or runs for its job alone (docs/design/cohort-outputs.md)."""
        with self._lock:
            parked = self._windows.want(job_id, batch_id)
            member = self.members.get(job_id)
            if parked is not None and member is not None:
                batch, entry = parked
                if self._admit(member, batch_id) is Admission.SERVE:
                    self._serve(batch, entry)
                elif not self._copy(batch, entry):
                    self._outbox.runs.append(batch)
                self._uncache_served()
        self._flush()

    def sender_left(self, job_id: int, first_id: int, end_id: int) -> None:
        """The worker that sent ``job_id``'s batches ``first_id <= id < end_id`` left: its
        leases stop counting in the job's window, its parked batches are dropped (nobody will
        ask for them: Note [A job's window])."""
        with self._lock:
            self._leases.sender_left(job_id, first_id, end_id)
            self._windows.sender_left(job_id, first_id, end_id)
            self._serve_parked(job_id)
            self._uncache_served()
        self._flush()

    def take_retired(self, job_id: int) -> tuple[str, ...]:
        """The cohort's slabs freed since ``job_id`` last heard, for its trainer to unmap."""
        with self._lock:
            return self._leases.take_retired(job_id)

    # --- figures --------------------------------------------------------------------------------

    def status(self) -> CohortStatus:
        with self._lock:
            entries = {id(e): e for e in self._leases.entries()}
            entries.update((id(e), e) for e in self._cache.entries())
            return self._figures.status(
                tuple(sorted(self.members)),
                held_bytes=self._cache.held_bytes(),
                leased_bytes=sum(e.nbytes for e in entries.values() if e.leases),
                window_bytes=self.window_bytes,
                dropped=self._cache.dropped,
                device_bytes=self._leases.device_bytes,
            )

    def close(self) -> bool:
        """Closes the cohort's memory (its last member has gone) and frees it, but for GPU
        slabs that members' processes may still map: whether some do (then :meth:`reap` and
        :meth:`free` once ``awaiting_peers`` is false, or at the daemon's exit). Idempotent."""
        with self._lock:
            self._closed = True
            self._cache.clear()
            self._leases.clear()
        if self.outputs.close():
            return True
        self.outputs.free()
        return False

    def free(self) -> None:
        """Frees all the cohort's memory, what members' processes still map included."""
        self.outputs.close()
        self.outputs.free()

    # --- under the lock -------------------------------------------------------------------------

    def _lease(
        self, entry: Entry, job_id: int, settle: Settle | None, batch: PendingBatch
    ) -> tuple[OutputDescriptor, ...]:
        """Leases ``entry``'s regions to ``job_id``, which takes its share of the run."""
        descriptors = self._leases.lease(entry, job_id, settle, batch.batch_id)
        self._give_share(entry, job_id)
        self._figures.served_one(job_id)
        return descriptors

    def _lease_ended(self, lease: Lease) -> Settle | None:
        settle = self._leases.end(lease)
        self._cache.free_if_done(lease.entry)
        self._uncached(self._cache.fit_window(self.members))
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
            retired_slabs=self._leases.take_retired(member.job_id),
            event=entry.event if entry.on_gpu else "",
        )

    def _uncache_served(self) -> None:
        self._uncached(self._cache.uncache_served(self.members))

    def _uncached(self, entries: list[Entry]) -> None:
        """Entries that left the cache: batches parked on them run for their own jobs."""
        for entry in entries:
            self._outbox.runs += self._windows.drop_parked_on(entry)

    def _give_share(self, entry: Entry, job_id: int) -> None:
        self._outbox.charges += entry.charge.share(job_id)

    def _admit(self, member: Member, batch_id: int) -> Admission:
        return self._windows.admit(member, batch_id, self._leases.counted(member.job_id))

    def _serve_parked(self, job_id: int) -> None:
        """Serves ``job_id``'s parked batches, oldest first, while its window has room."""
        member = self.members.get(job_id)
        while member is not None:
            oldest = self._windows.oldest(job_id)
            if oldest is None:
                return
            batch_id, batch, entry = oldest
            if self._admit(member, batch_id) is not Admission.SERVE:
                return
            self._windows.unpark(job_id, batch_id)
            self._serve(batch, entry)

    def _serve(self, batch: PendingBatch, entry: Entry) -> None:
        """A parked batch, served from ``entry`` now (answered by ``_flush``)."""
        member = batch.member
        assert member is not None
        self._figures.hits += 1
        descriptors = self._lease(entry, member.job_id, None, batch)
        self._outbox.answers.append((batch, self._ready(batch, entry, descriptors)))

    def _copy(self, batch: PendingBatch, entry: Entry) -> bool:
        """A batch past its member's window, served from ``entry`` as private copies rather
        than run again, where its trainer takes copies; whether it will be. The entry stays
        pinned until ``_flush`` has copied its bytes."""
        member = batch.member
        assert member is not None
        if member.outputs.copy_after is None or entry.state is not EntryState.READY:
            return False  # a trainer that takes no copies: its run waits for its memory
        self._figures.hits += 1
        self._figures.served_one(member.job_id)
        self._give_share(entry, member.job_id)
        self._leases.pin(entry)
        self._outbox.copies.append((batch, entry))
        return True

    def _copied(self, batch: PendingBatch, entry: Entry) -> BatchReady | None:
        """The copies ``_copy`` promised, its pin of the entry ended; None if the cohort
        closed meanwhile (its last member, this one, left). Under the lock, so that ``close``
        cannot unmap the regions while they are read: one batch's copy, not a run."""
        member = batch.member
        assert member is not None
        with self._lock:
            if self._closed:
                return None
            try:
                # GPU outputs into the member's copy memory, on its stream: no host wait here.
                descriptors, copies, event = member.outputs.copies_from(
                    self.outputs, entry.descriptors
                )
            finally:
                self._leases.unpin(entry)
                self._cache.free_if_done(entry)
                self._uncached(self._cache.fit_window(self.members))
            retired = self._leases.take_retired(member.job_id) + member.outputs.take_retired()
        return BatchReady(
            batch.batch_id,
            member.pipeline_id,
            descriptors,
            retired_slabs=retired,
            event=event,
            copies=copies,
        )

    def _rank(self, job_id: int, behind: bool) -> None:
        """``job_id`` is behind the window now, or not: told to the scheduler by ``_flush``, on
        a change only."""
        if self._figures.rank(job_id, behind):
            self._outbox.ranks.append((job_id, behind))

    def _flush(self) -> None:
        """What the lock's holders left to do outside it: ranks, charges, answers, runs."""
        with self._lock:
            outbox, self._outbox = self._outbox, _Outbox()
        for job_id, behind in outbox.ranks:
            self._behind(job_id, behind)
        for job_id, seconds, moves_tag in outbox.charges:
            (self._share if moves_tag else self._charge)(job_id, seconds)
        answers = outbox.answers
        for batch, entry in outbox.copies:
            copied = self._copied(batch, entry)
            if copied is not None:
                answers.append((batch, copied))
        for batch, ready in answers:
            member = batch.member
            if member is not None and not member.closed:
                member.answer(batch, ready)
        for batch in outbox.runs:
            _resubmit(batch)


def _resubmit(batch: PendingBatch) -> None:
    """A batch that waited for a run it no longer gets: it runs for its own job."""
    member = batch.member
    if member is None or member.closed:
        return
    if member.executor is None or member.failed:
        member.answer(
            batch,
            BatchFailed(
                batch.batch_id,
                member.pipeline_id,
                ErrorCode.PIPELINE_ERROR,
                "the pipeline stopped working and takes no more batches",
            ),
        )
        return
    member.executor.submit(batch)


def resubmit(batches: Sequence[PendingBatch]) -> None:
    """Batches whose cohort run was abandoned: each runs for its own job."""
    for batch in batches:
        _resubmit(batch)


def _on_gpu(output: RunOutput) -> bool:
    return type(output.tensors).__name__.endswith("GPU")


def _maps_gpu(member: Member) -> bool:
    """Whether ``member``'s trainer maps GPU memory by CUDA IPC (else its GPU outputs are
    staged: ``cuda_staged.py``), so may be given the cohort's GPU regions."""
    return any(store.device == "cuda" for store in member.outputs.stores)
