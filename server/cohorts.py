"""Cohorts: jobs that read the same data through the same pipeline pay for its preprocessing once.

A job joins a cohort by name when it registers a pipeline; every member must register the same
graph. A batch a member submits is matched by its inputs' content against the batches of the
other members: a cheap digest finds a candidate, an exact comparison of the bytes decides. A
batch that matches nothing becomes an *entry* and runs (for its job, and for whoever submits the
same inputs meanwhile); one that matches an entry is served its outputs without a run.

Note [Cohort outputs]
---------------------
1. Where. A run of an entry writes its rows into the cohort's own shared-memory pool (one
   :class:`~dalid.server.outputs.JobOutputs`, CPU only), whose slabs every member's trainer maps
   by name like its own. Every member served the entry gets descriptors of the same regions,
   under region ids of its own (from ``COHORT_REGION_BASE`` up: a job's own ids count from 1),
   so a release names the member's lease, never another's.
2. Leases. An entry's regions go back to the cohort's pool once no member holds a lease of them
   and the entry has left the cache. A member's lease ends when its trainer released every
   region of it, or when its job ended and its trainer process is gone (a trainer that said
   goodbye but still views a region keeps it until its process exits: the pool would reuse it
   under its tensors otherwise).
3. The cache. A ready entry waits for the members not served yet. It leaves the cache once
   every member has been served it, or, oldest first, when the bytes waiting only for trailing
   members pass ``window_bytes`` or the pool needs their room for a new run. A trailing member
   whose batch finds no entry any more gets a run of its own (and that run is an entry for
   members further behind). So a stalled member holds at most its own leases (as many batches
   as its DataLoader has asked for) and a share of ``window_bytes``, and stalls no one.
4. What is not shared. Outputs the pool cannot take (GPU outputs, or no room even after the
   cache is emptied) are written from the one run into each member's own memory: the
   preprocessing still ran once, the copy is the member's. A run that fails or has bad samples
   shares nothing: its followers run for themselves, each under its own ``on_error``.
5. Charging. A run is charged once, split among the members that were waiting for it (its
   producer and followers); a later hit from the cache is served without a charge.

The daemon's cohorts by name, and who may join one, are ``cohort_registry.py``; how batches are
compared, ``cohort_matching.py``.

Why one module of some 520 lines: the note above is the lifetime contract of a cohort's
regions, and the one class here keeps every point of it under one lock.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dalid.protocol import (
    BatchFailed,
    BatchReady,
    CohortStatus,
    ErrorCode,
    InputBatch,
    OutputDescriptor,
)

from .cohort_matching import batch_digest, same_inputs
from .outputs import JobOutputs, OutputFailure, RunOutput
from .pool import PoolClosed, PoolFull

if TYPE_CHECKING:
    from .runs import Member, PendingBatch

log = logging.getLogger("dalid.server")

# Region ids of cohort leases start here; a job's own regions count from 1 and never get there.
COHORT_REGION_BASE = 1 << 48

Settle = Callable[[], None]
Alive = Callable[[int, int], bool]


@dataclass(eq=False)
class _Lease:
    """One member's lease of an entry's regions: the ids it was given, not yet released."""

    entry: Entry
    job_id: int
    remaining: set[int]
    settle: Settle | None = None


@dataclass(eq=False)
class Entry:
    """A batch's inputs, the run that serves them to every member, and its outputs once run."""

    cohort: Cohort
    digest: bytes
    inputs: tuple[InputBatch, ...]
    unreadable: tuple[int, ...]
    producer: PendingBatch | None
    followers: list[PendingBatch] = field(default_factory=list)
    # "pending" (queued or running), "ready" (outputs in the cohort's memory), "gone".
    state: str = "pending"
    served: set[int] = field(default_factory=set)  # the jobs given it, or waiting for it
    descriptors: tuple[OutputDescriptor, ...] = ()
    nbytes: int = 0
    leases: int = 0
    cached: bool = False

    def payers(self) -> list[int]:
        """The jobs that share the charge of its run: its producer's and its followers'."""
        batches = [self.producer, *self.followers]
        return [b.member.job_id for b in batches if b is not None and b.member is not None]


class Outcome:
    """What a submitted batch of a member becomes (:meth:`Cohort.take`)."""

    RUN = "run"  # runs, as an entry other members may match
    FOLLOW = "follow"  # waits for another member's run of the same inputs
    HIT = "hit"  # served now, from the cache


class Cohort:
    """The members of one cohort, its entries and the shared memory their outputs live in.

    Thread-safe: the I/O thread submits, releases and removes members; executor threads write
    and publish runs. ``outputs``: the cohort's own CPU output memory; ``window_bytes``: the most
    bytes of outputs held for trailing members only (Note [Cohort outputs], point 3); ``alive``
    tells whether a trainer process lives (pid, pid namespace).
    """

    def __init__(
        self,
        name: str,
        key: Hashable,
        outputs: JobOutputs,
        window_bytes: int,
        alive: Alive,
    ) -> None:
        self.name = name
        self.key = key
        self.outputs = outputs
        self.window_bytes = window_bytes
        self._alive = alive
        self._lock = threading.Lock()
        self.members: dict[int, Member] = {}
        self._by_digest: dict[bytes, list[Entry]] = {}
        self._cache: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self._leases: dict[tuple[int, int], _Lease] = {}
        # Leases of members gone whose trainer process still lives: (job, pid, namespace).
        self._lingering: dict[int, tuple[int, int]] = {}
        self._ids = itertools.count(COHORT_REGION_BASE)
        self._retired: dict[int, list[str]] = {}
        self.served: dict[int, int] = {}  # batches served to each member
        self.runs = 0
        self.hits = 0
        self.dropped = 0
        self.copied = 0

    # --- members --------------------------------------------------------------------------------

    def join(self, member: Member) -> None:
        with self._lock:
            self.members[member.job_id] = member
            self.served.setdefault(member.job_id, 0)
            self._retired.setdefault(member.job_id, [])
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
            self.served.pop(job_id, None)
            self._retired.pop(job_id, None)
            for entries in list(self._by_digest.values()):
                for entry in list(entries):
                    if entry.state != "pending":
                        continue
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
                            self._drop(entry)
            if any(key[0] == job_id for key in self._leases):
                if pid > 0 and self._alive(pid, namespace):
                    self._lingering[job_id] = (pid, namespace)
                else:
                    self._end_leases_of(job_id)
            self._uncache_served()
        for batch in resubmit:
            _resubmit(batch)

    def reap(self) -> None:
        """Ends the leases of members gone whose trainer process has exited since."""
        with self._lock:
            for job_id, (pid, namespace) in list(self._lingering.items()):
                if not self._alive(pid, namespace):
                    del self._lingering[job_id]
                    self._end_leases_of(job_id)

    @property
    def empty(self) -> bool:
        return not self.members

    # --- submissions ----------------------------------------------------------------------------

    def take(self, batch: PendingBatch) -> tuple[str, BatchReady | None]:
        """Matches a member's submitted batch: served now from the cache (HIT, with its
        result), waiting for another member's run (FOLLOW: answered when it ends), or to run
        (RUN: ``batch.cohort_entry`` is its entry)."""
        member = batch.member
        assert member is not None
        request = batch.request
        digest = batch_digest(request.inputs, request.unreadable)
        with self._lock:
            for entry in self._by_digest.get(digest, ()):
                if member.job_id in entry.served or entry.state == "gone":
                    continue  # a job never gets its own outputs again (a second epoch, say)
                if entry.state == "ready" and not entry.cached:
                    continue
                if not same_inputs(
                    entry.inputs, request.inputs, entry.unreadable, request.unreadable
                ):
                    continue
                entry.served.add(member.job_id)
                if entry.state == "pending":
                    entry.followers.append(batch)
                    return Outcome.FOLLOW, None
                self.hits += 1
                descriptors = self._lease(entry, member.job_id, None)
                ready = self._ready(batch, descriptors)
                self._uncache_served()
                return Outcome.HIT, ready
            entry = Entry(
                self,
                digest,
                tuple(request.inputs),
                tuple(request.unreadable),
                batch,
                served={member.job_id},
            )
            self._by_digest.setdefault(digest, []).append(entry)
            batch.cohort_entry = entry
            return Outcome.RUN, None

    # --- runs (executor threads) ----------------------------------------------------------------

    def write(
        self, outputs: Sequence[RunOutput], rows: range, source_stream: int | None
    ) -> tuple[OutputDescriptor, ...] | None:
        """Copies an entry's rows of a run into the cohort's memory; None where they cannot go
        there (Note [Cohort outputs], point 4)."""
        if not all(type(output.tensors).__name__ == "TensorListCPU" for output in outputs):
            return None
        while True:
            try:
                descriptors, _ = self.outputs.write_batch(
                    outputs, rows, source_stream=source_stream, wait=False
                )
                return descriptors
            except PoolFull:
                with self._lock:
                    if not self._evict_oldest():
                        return None
            except (OutputFailure, PoolClosed):
                return None

    def publish(
        self, entry: Entry, descriptors: tuple[OutputDescriptor, ...], settle: Settle
    ) -> list[tuple[PendingBatch, BatchReady]]:
        """The run of ``entry`` is in the cohort's memory: the results for its producer (whose
        window ``settle`` frees once its trainer released them) and its followers."""
        results = []
        with self._lock:
            entry.state = "ready"
            entry.descriptors = descriptors
            entry.nbytes = sum(d.nbytes for d in descriptors)
            recipients = [b for b in (entry.producer, *entry.followers) if b is not None]
            entry.followers = []
            self.runs += 1
            self.hits += len(recipients) - 1
            for batch in recipients:
                member = batch.member
                assert member is not None
                if member.closed or member.job_id not in self.members:
                    continue
                own = settle if batch is entry.producer else None
                results.append((batch, self._ready(batch, self._lease(entry, member.job_id, own))))
            entry.cached = True
            self._cache[id(entry)] = entry
            self._uncache_served()
            self._free_if_done(entry)
        return results

    def take_recipients(self, entry: Entry) -> list[PendingBatch]:
        """The run of ``entry`` cannot go to the cohort's memory: its producer and followers,
        each to be written into its own memory from the run (Note [Cohort outputs], point 4)."""
        with self._lock:
            recipients = [b for b in (entry.producer, *entry.followers) if b is not None]
            entry.followers = []
            self.copied += 1
            self.runs += 1
            self.hits += len(recipients) - 1
            self._drop(entry)
        for batch in recipients:
            batch.cohort_entry = None
        return recipients

    def abandon(self, entry: Entry) -> list[PendingBatch]:
        """The run of ``entry`` failed or had bad samples: nothing of it is shared; its
        followers, to run for themselves."""
        with self._lock:
            followers, entry.followers = entry.followers, []
            self._drop(entry)
        for batch in followers:
            batch.cohort_entry = None
        return followers

    # --- releases (the I/O thread) --------------------------------------------------------------

    def release(self, job_id: int, region_ids: Sequence[int]) -> list[int]:
        """Ends ``job_id``'s leases of these cohort region ids; returns the ids not leased."""
        unknown = []
        settled: list[Settle] = []
        with self._lock:
            for region_id in region_ids:
                lease = self._leases.pop((job_id, region_id), None)
                if lease is None:
                    unknown.append(region_id)
                    continue
                lease.remaining.discard(region_id)
                if not lease.remaining:
                    self._end_lease(lease, settled)
        for settle in settled:
            settle()
        return unknown

    def take_retired(self, job_id: int) -> tuple[str, ...]:
        """The cohort's slabs freed since ``job_id`` last heard, for its trainer to unmap."""
        with self._lock:
            return self._take_retired(job_id)

    # --- figures --------------------------------------------------------------------------------

    def status(self) -> CohortStatus:
        with self._lock:
            counts = list(self.served.values())
            held = sum(e.nbytes for e in self._cache.values() if not e.leases)
            leased = sum(e.nbytes for e in self._cache_and_leased() if e.leases)
            runs, hits = self.runs, self.hits
            return CohortStatus(
                name=self.name,
                jobs=tuple(sorted(self.members)),
                runs=runs,
                hits=hits,
                hit_rate=hits / (runs + hits) if runs + hits else 0.0,
                lag_batches=max(counts) - min(counts) if counts else 0,
                held_bytes=held,
                window_bytes=self.window_bytes,
                leased_bytes=leased,
                dropped=self.dropped,
                copied=self.copied,
            )

    def close(self) -> None:
        """Frees the cohort's memory (its last member has gone). Idempotent."""
        with self._lock:
            self._by_digest.clear()
            self._cache.clear()
            self._leases.clear()
        self.outputs.close()
        self.outputs.free()

    # --- under the lock -------------------------------------------------------------------------

    def _cache_and_leased(self) -> list[Entry]:
        entries = {id(lease.entry): lease.entry for lease in self._leases.values()}
        entries.update((id(e), e) for e in self._cache.values())
        return list(entries.values())

    def _lease(
        self, entry: Entry, job_id: int, settle: Settle | None
    ) -> tuple[OutputDescriptor, ...]:
        ids = [next(self._ids) for _ in entry.descriptors]
        lease = _Lease(entry, job_id, set(ids), settle)
        for region_id in ids:
            self._leases[(job_id, region_id)] = lease
        entry.leases += 1
        self.served[job_id] = self.served.get(job_id, 0) + 1
        return tuple(
            dataclasses.replace(descriptor, region_id=region_id)
            for descriptor, region_id in zip(entry.descriptors, ids, strict=True)
        )

    def _ready(self, batch: PendingBatch, descriptors: tuple[OutputDescriptor, ...]) -> BatchReady:
        member = batch.member
        assert member is not None
        return BatchReady(
            batch.batch_id,
            member.pipeline_id,
            descriptors,
            retired_slabs=self._take_retired(member.job_id),
        )

    def _take_retired(self, job_id: int) -> tuple[str, ...]:
        retired = self.outputs.take_retired()
        if retired:
            for names in self._retired.values():
                names.extend(retired)
        mine = self._retired.get(job_id)
        if not mine:
            return ()
        taken = tuple(mine)
        mine.clear()
        return taken

    def _end_lease(self, lease: _Lease, settled: list[Settle]) -> None:
        entry = lease.entry
        entry.leases -= 1
        if lease.settle is not None:
            settled.append(lease.settle)
        self._free_if_done(entry)
        self._fit_window()

    def _end_leases_of(self, job_id: int) -> None:
        settled: list[Settle] = []
        ended = {id(lease): lease for key, lease in self._leases.items() if key[0] == job_id}
        for key in [key for key in self._leases if key[0] == job_id]:
            del self._leases[key]
        for lease in ended.values():
            lease.settle = None  # its job is gone: no window to free
            self._end_lease(lease, settled)

    def _uncache_served(self) -> None:
        """Entries every member has been served leave the cache."""
        members = set(self.members)
        for entry in [e for e in self._cache.values() if members <= e.served]:
            self._uncache(entry)
        self._fit_window()

    def _fit_window(self) -> None:
        """The oldest outputs held only for trailing members go, past ``window_bytes``."""
        held = sum(e.nbytes for e in self._cache.values() if not e.leases)
        for entry in list(self._cache.values()):
            if held <= self.window_bytes:
                break
            if not entry.leases:
                held -= entry.nbytes
                self.dropped += 1
                self._uncache(entry)

    def _evict_oldest(self) -> bool:
        """Drops the oldest cached outputs no member holds, to make room; whether any went."""
        for entry in list(self._cache.values()):
            if not entry.leases:
                self.dropped += 1
                self._uncache(entry)
                return True
        return False

    def _uncache(self, entry: Entry) -> None:
        self._cache.pop(id(entry), None)
        entry.cached = False
        self._forget(entry)
        self._free_if_done(entry)

    def _free_if_done(self, entry: Entry) -> None:
        if entry.state == "ready" and not entry.cached and not entry.leases:
            entry.state = "gone"
            self.outputs.release([d.region_id for d in entry.descriptors])

    def _drop(self, entry: Entry) -> None:
        entry.state = "gone"
        self._forget(entry)

    def _forget(self, entry: Entry) -> None:
        entries = self._by_digest.get(entry.digest)
        if entries is not None and entry in entries:
            entries.remove(entry)
            if not entries:
                del self._by_digest[entry.digest]


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
