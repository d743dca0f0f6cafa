"""Cohorts: jobs that read the same data through the same pipeline pay for its preprocessing once.

A job joins a cohort by name when it registers a pipeline; every member must register the same
graph. A batch a member submits is matched by its inputs' content against the batches of the
other members: a cheap digest finds a candidate, an exact comparison of the bytes decides. A
batch that matches nothing becomes an *entry* and runs (for its job, and for whoever submits the
same inputs meanwhile); one that matches an entry is served its outputs without a run.

Note [Cohort outputs]
---------------------
1. Where. A run of an entry writes its rows into the cohort's own memory (one
   :class:`~dalid.server.outputs.job_outputs.JobOutputs`, of the stores a job has: shared memory,
   and on a GPU daemon device memory, each at most ``--cohort-memory``), whose slabs every
   member's trainer maps like its own: by name, or a GPU slab by its CUDA IPC handle, opened
   once per process. Every member served the entry gets descriptors of the same regions, under
   region ids of its own (from ``COHORT_REGION_BASE`` up: a job's own ids count from 1), so a
   release names the member's lease, never another's; with GPU outputs, the run's one batch
   event, on which its trainer's stream waits (never a host wait). The device store knows each
   member as a peer of its own (``CudaStore.give``, Note [GPU output lifetime] in cuda.py): a
   member's release fence is waited on by the cohort's stream before its lease ends, so a
   region is written again only after every member's last use; a GPU slab the pool lets go of
   is freed once every member given it has unmapped it, left it out of its goodbye's
   ``kept_slabs``, or is gone (its process exited: ``reap``; one the daemon cannot watch, at
   the daemon's exit). A cohort that ends while a live process maps its slabs is freed then.
2. Leases. An entry's regions go back to the cohort's pool once no member holds a lease of them
   and the entry has left the cache. A member's lease ends when its trainer released every
   region of it, or when its job ended and its trainer process is gone (a trainer that said
   goodbye but still views a region keeps it until its process exits: the pool would reuse it
   under its tensors otherwise).
3. The cache. A ready entry waits for the members not served yet. It leaves the cache once
   every member has been served it, or, oldest first, when the bytes waiting only for trailing
   members pass ``window_bytes`` or the pool needs their room for a new run. A trailing member
   whose batch finds no entry any more gets a run of its own (and that run is an entry for
   members further behind). So a stalled member holds at most its own leases (point 6) and a
   share of ``window_bytes``, and stalls no one.
4. What is not shared. Outputs the pool cannot take (no room even after the cache is
   emptied; GPU outputs on a daemon without a GPU store) are written from the one run into each
   member's own memory: the preprocessing still ran once, the copy is the member's (``copied``
   in the status). So are a run's GPU outputs for a member whose trainer cannot map the
   daemon's GPU memory (its job's GPU outputs are staged: ``cuda_staged.py``) that waited for
   the run (its producer or a follower); such a member's batch that finds a run already done
   runs for its job alone, since nothing but a mapping would serve it without a copy. The
   others still share the regions. A run that fails or has bad samples shares nothing: its
   followers run for themselves, each under its own ``on_error``.
5. Charging. A run is charged once, split among the members that consumed it: its producer
   when it ends, then each member as it is given the run's outputs (a follower at publication
   or once its window has room, a member served from the cache later, a copy written into a
   member's own memory), whose share is taken back from the others' (the parts always add up
   to the run's service time). A follower that is never given them (it left, its window kept
   it out until the entry went, the run failed) takes no share: it pays for its own run. The
   fair scheduler's tags move with the shares (``FairScheduler.share_run``): the producer's
   slot paid for the whole run, and gets back what the others take on. Without that, a member
   that leads (and so produces every run) would weigh as one job against a trailing member's
   runs of its own, and the cohort as a whole would get no more of the daemon than that one.
6. A member's window. The batches a member was served from other members' runs (hits and
   follows) count in its job's window (Note [A job's window] in run_planner.py) beside its own
   runs: a member whose window is full is not served more until its trainer releases some;
   its batch waits, parked on the entry, in the cache (so within ``window_bytes``: dropped
   from it, the batch runs for its job alone). The batch its trainer waits for
   (``want_batch``) passes a full window by ``TRAINER_HOLDS + 1``, as a run does. Past that
   (a trainer that keeps its outputs), it is served a private copy of the entry's outputs
   (Note [Private copies] in copies.py) instead of a run of its own: the bytes leave the
   daemon with the answer and nothing of the cohort's memory stays leased, so a trainer that
   keeps every output holds no more than its window of the cohort's memory, and a copy costs
   a copy, where a second run cost the whole pipeline. A trainer that takes no copies has its
   batch run for its job alone, where it waits for its own memory as the run path does. A
   keeper's batch that finds no entry (it leads, overflowing its window: Note [A job's
   window], point 4) still runs for its job alone, into its own memory, and is no entry:
   shared, its outputs would be leased past its window from the cohort's memory, which has
   no room for a trainer that keeps them; a member behind it runs those inputs again.
   The batches of a worker that left stop counting, and those parked are dropped (point 6 of
   that note).
7. Inputs. An entry keeps its producer's batch, and so its input frames (counted in
   ``--input-memory`` as long as the batch lives: inputs.py), only while other members may
   still match it; once it leaves the cache it lets go of both, and the count goes with them.
8. Past the window. A member whose batch finds no entry because the entry of the same inputs
   left the cache before it was served (point 3) trails past the window: it is *behind*. Its
   batches run for it alone, and they would take a fair share of the daemon from the members
   in step (a member that waits 0.1 s a batch asks for half of a 2-core machine's decoding),
   so while it is behind the fair scheduler ranks them at ``BEHIND_SHARE`` of its weight
   (``FairScheduler.set_behind``): the cohort's shared runs come first, it takes what they
   leave, and that fraction is its floor, so it still gets every batch. And a run of it
   starts only on an instance of the pipeline with no run in flight, unless its turn came
   (``RunPlanner._behind_waits``): a run started in a moment the others left the pipeline
   cannot be preempted, and kept their next batch out. Its charges stay
   those of point 5 (it pays its own runs alone). It regains its rank once a batch of it
   matches an entry again, or finds inputs no member ran (it leads or caught up). The
   digests of entries that left unserved are kept, a bounded number, to tell "behind" from
   "ahead"; a digest that collides only changes a rank, never an output.

The daemon's cohorts by name, and who may join one, are ``cohort_registry.py``; how batches are
compared, ``cohort_matching.py``.

Why one module of some 1,030 lines: the note above is the lifetime contract of a cohort's
regions, and the one class here keeps every point of it under one lock: a member's window
(point 6) decides which leases are made, the charges (point 5) follow the leases and copies,
and the GPU slabs each member may map (point 1) follow the leases too.
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

from ..outputs.cuda_store import CudaStore
from ..outputs.job_outputs import JobOutputs
from ..outputs.pool import PoolClosed, PoolFull
from ..outputs.run_output import OutputFailure, RunOutput
from .cohort_matching import batch_digest, same_inputs
from .run_planner import TRAINER_HOLDS

if TYPE_CHECKING:
    from .runs import Member, PendingBatch

log = logging.getLogger("dalid.server")

# Region ids of cohort leases start here; a job's own regions count from 1 and never get there.
COHORT_REGION_BASE = 1 << 48

Settle = Callable[[], None]
Alive = Callable[[int, int], bool]
# charge(job_id, seconds): counts seconds of a run to a job's ``run_seconds``; share(job_id,
# seconds) also moves its fair-share tag (FairScheduler.share_run); negative, takes back.
Charge = Callable[[int, float], None]


def no_charge(job_id: int, seconds: float) -> None:
    pass


# rank(job_id, behind): a member fell past the window, or is back (FairScheduler.set_behind).
Rank = Callable[[int, bool], None]


def no_rank(job_id: int, behind: bool) -> None:
    pass


# How many digests of entries that left the cache unserved are kept (point 8): some 40 bytes
# each, and more than any window holds batches.
_PASSED_KEPT = 4096


@dataclass(eq=False)
class _Lease:
    """One member's lease of an entry's regions: the ids it was given, not yet released."""

    entry: Entry
    job_id: int
    remaining: set[int]
    settle: Settle | None = None
    batch_id: int = 0
    # Counts in its job's window (Note [Cohort outputs], point 6): a hit's or a follow's lease,
    # until released or its worker left; a producer's counts in the planner's window instead.
    counted: bool = False


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
    # The run's batch event, where it wrote GPU outputs: every member's stream waits on it.
    event: str = ""
    nbytes: int = 0
    leases: int = 0
    cached: bool = False
    # Batches of members whose window was full, waiting for room (point 6).
    parked: int = 0
    # The service time of its run, and the jobs it has been charged to so far (point 5).
    cost: float = 0.0
    charged: list[int] = field(default_factory=list)

    def payers(self) -> list[int]:
        """The jobs waiting for its run: its producer's and its followers'."""
        batches = [self.producer, *self.followers]
        return [b.member.job_id for b in batches if b is not None and b.member is not None]

    # Its run, as the executor that runs it sees it (runs.CohortRun): the cohort's to settle.

    def write(
        self, outputs: Sequence[RunOutput], rows: range, source_stream: int | None
    ) -> tuple[OutputDescriptor, ...] | None:
        return self.cohort.write(outputs, rows, source_stream, self)

    @property
    def on_gpu(self) -> bool:
        """Whether its outputs are in the cohort's GPU memory (point 1)."""
        return any(d.device == "cuda" for d in self.descriptors)

    def account(self, seconds: float) -> None:
        self.cohort.account(self, seconds)

    def publish(
        self, descriptors: tuple[OutputDescriptor, ...], settle: Settle
    ) -> list[tuple[PendingBatch, BatchReady | None]]:
        return self.cohort.publish(self, descriptors, settle)

    def take_recipients(self) -> list[PendingBatch]:
        return self.cohort.take_recipients(self)

    def abandon(self) -> list[PendingBatch]:
        return self.cohort.abandon(self)


class Outcome:
    """What a submitted batch of a member becomes (:meth:`Cohort.take`)."""

    RUN = "run"  # runs, as an entry other members may match
    FOLLOW = "follow"  # waits for another member's run of the same inputs
    HIT = "hit"  # served now, from the cache
    PARKED = "parked"  # served from the cache once its job's window has room (point 6)
    ALONE = "alone"  # runs for its job alone, as a batch of no cohort (point 6)


# What a member's window lets a batch served from the cohort do (Note [Cohort outputs], point 6).
_SERVE, _PARK, _ALONE = "serve", "park", "alone"


class Cohort:
    """The members of one cohort, its entries and the memory their outputs live in.

    Thread-safe: the I/O thread submits, releases and removes members; executor threads write
    and publish runs. ``outputs``: the cohort's own output memory (shared memory, and on a GPU
    daemon device memory every member maps: Note [Cohort outputs], point 1); ``window_bytes``:
    the most bytes of outputs held for trailing members only (point 3); ``alive`` tells whether
    a trainer process lives (pid, pid namespace); ``charge`` counts a share of a run to a job
    (point 5).
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
        # Its GPU memory, on a GPU daemon: each slab mapped by the members given its regions.
        self._device = next((s for s in outputs.stores if isinstance(s, CudaStore)), None)
        if self._device is not None:
            self._device.for_members()
        # Members gone whose trainer process may still map its GPU slabs: (pid, namespace).
        self._mapping: dict[int, tuple[int, int]] = {}
        self.window_bytes = window_bytes
        self._alive = alive
        self._charge = charge
        self._share = share
        self._behind = behind
        self._lock = threading.Lock()
        self.members: dict[int, Member] = {}
        self._by_digest: dict[bytes, list[Entry]] = {}
        self._cache: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self._leases: dict[tuple[int, int], _Lease] = {}
        # Leases of members gone whose trainer process still lives: (job, pid, namespace).
        self._lingering: dict[int, tuple[int, int]] = {}
        self._ids = itertools.count(COHORT_REGION_BASE)
        self._retired: dict[int, list[str]] = {}
        # Per member: its leases that count in its window, and its parked batches by id.
        self._counted: collections.Counter[int] = collections.Counter()
        self._parked: dict[int, dict[int, tuple[PendingBatch, Entry]]] = {}
        self._wanted: dict[int, int] = {}  # the batch each member's trainer waits for
        # Outside the lock, by the public method that filled them: batches to run for their
        # own job (their entry went while they were parked), results to answer, charges.
        self._to_run: list[PendingBatch] = []
        self._to_answer: list[tuple[PendingBatch, BatchReady]] = []
        self._to_copy: list[tuple[PendingBatch, Entry]] = []  # served as private copies
        self._charges: list[tuple[int, float, bool]] = []  # (job, seconds, tag moves too)
        self.served: dict[int, int] = {}  # batches served to each member
        # Point 8: the digests of entries that left the cache unserved, and the members that
        # were not served them; the members behind now, and the batches run for them so.
        self._passed: collections.OrderedDict[bytes, set[int]] = collections.OrderedDict()
        self.behind: set[int] = set()
        self.behind_runs = 0
        self._ranks: list[tuple[int, bool]] = []
        self._closed = False
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
            self._parked.setdefault(member.job_id, {})
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
            self._wanted.pop(job_id, None)
            self.behind.discard(job_id)
            for _, entry in self._parked.pop(job_id, {}).values():
                entry.parked -= 1
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
            if self._device is not None:
                self._device.forget_fences(job_id)  # while its trainer may still have them
            if self._device is not None and self._device.maps(job_id):
                if pid > 0 and not self._alive(pid, namespace):
                    self._device.peer_gone(job_id)  # what it mapped went with its process
                else:
                    # Its slabs not kept at its goodbye were let go of then (``peer_leaving``);
                    # a process the daemon cannot watch keeps the rest until the daemon exits.
                    self._mapping[job_id] = (pid, namespace)
            self._uncache_served()
        for batch in resubmit:
            _resubmit(batch)
        self._flush()

    def reap(self) -> None:
        """Ends the leases of members gone whose trainer process has exited since, and lets
        the cohort's GPU slabs they mapped go."""
        with self._lock:
            for job_id, (pid, namespace) in list(self._lingering.items()):
                if not self._alive(pid, namespace):
                    del self._lingering[job_id]
                    self._end_leases_of(job_id)
            for job_id, (pid, namespace) in list(self._mapping.items()):
                if pid > 0 and not self._alive(pid, namespace):
                    del self._mapping[job_id]
                    if self._device is not None:
                        self._device.peer_gone(job_id)

    def peer_leaving(self, job_id: int, kept_slabs: Sequence[str]) -> None:
        """The trainer of member ``job_id`` said goodbye: it maps ``kept_slabs`` still, and no
        other slab of the cohort's GPU memory (Note [GPU output lifetime] in cuda.py)."""
        if self._device is not None:
            self._device.peer_leaving(kept_slabs, job_id)

    @property
    def awaiting_peers(self) -> bool:
        """Whether GPU slabs of the closed cohort wait for members' processes to unmap them."""
        return self._device is not None and self._device.awaiting_peers

    @property
    def empty(self) -> bool:
        return not self.members

    # --- submissions ----------------------------------------------------------------------------

    def take(self, batch: PendingBatch) -> tuple[str, BatchReady | None]:
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
    ) -> tuple[str, BatchReady | None]:
        """``take``, under the lock."""
        request = batch.request
        for entry in self._by_digest.get(digest, ()):
            if member.job_id in entry.served or entry.state == "gone":
                continue  # a job never gets its own outputs again (a second epoch, say)
            if entry.state == "ready" and not entry.cached:
                continue
            if not same_inputs(entry.inputs, request.inputs, entry.unreadable, request.unreadable):
                continue
            if entry.state == "ready" and entry.on_gpu and not _maps_gpu(member):
                # It cannot map the cohort's GPU memory (point 4): it runs them for itself, and
                # the outputs wait for it no longer.
                entry.served.add(member.job_id)
                self._uncache_served()
                return Outcome.ALONE, None
            entry.served.add(member.job_id)
            self._rank(member.job_id, behind=False)
            if entry.state == "pending":
                entry.followers.append(batch)
                return Outcome.FOLLOW, None
            admit = self._admit(member, batch.batch_id)
            if admit == _PARK:
                self._park(batch, entry)
                return Outcome.PARKED, None
            if admit == _ALONE:
                if not self._copy(batch, entry):
                    return Outcome.ALONE, None
                self._uncache_served()
                return Outcome.HIT, None  # answered by ``_flush``, with its copies
            self.hits += 1
            descriptors = self._lease(entry, member.job_id, None, batch.batch_id)
            ready = self._ready(batch, entry, descriptors)
            self._uncache_served()
            return Outcome.HIT, ready
        passed = self._passed.get(digest)
        behind = passed is not None and member.job_id in passed
        if passed is not None and behind:
            passed.discard(member.job_id)
            if not passed:
                del self._passed[digest]
        self._rank(member.job_id, behind)
        if behind:
            self.behind_runs += 1
        if member.overflow:
            # Its trainer keeps its outputs (Note [A job's window], point 4): its runs go to its
            # own memory, as private copies once that is full, not to the cohort's.
            return Outcome.ALONE, None
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
        self,
        outputs: Sequence[RunOutput],
        rows: range,
        source_stream: int | None,
        entry: Entry | None = None,
    ) -> tuple[OutputDescriptor, ...] | None:
        """Copies an entry's rows of a run into the cohort's memory (the run's batch event, for
        GPU outputs, goes to ``entry``); None where they cannot go there (Note [Cohort
        outputs], point 4)."""
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
                    evicted = self._evict_oldest()
                self._flush()  # batches parked on what went run for their own jobs
                if not evicted:
                    return None
            except (OutputFailure, PoolClosed):
                return None

    def account(self, entry: Entry, seconds: float) -> None:
        """Charges ``seconds`` of service, the run of ``entry``, split among the jobs waiting
        for it (Note [Cohort outputs], point 5); members served it later take their share."""
        with self._lock:
            payers = entry.payers()
            if payers:
                # The producer's slot paid the run's tag. Its share goes to each follower only
                # as that one is given the outputs (``_lease``, ``take_recipients``): a follower
                # that leaves first, or runs alone past its window, pays for its own run alone.
                entry.cost += seconds
                self._charges.append((payers[0], seconds, False))
                entry.charged = payers[:1]
        self._flush()

    def publish(
        self, entry: Entry, descriptors: tuple[OutputDescriptor, ...], settle: Settle
    ) -> list[tuple[PendingBatch, BatchReady | None]]:
        """The run of ``entry`` is in the cohort's memory: the results for its producer (whose
        window ``settle`` frees once its trainer released them) and its followers; None for
        one whose trainer cannot map the cohort's GPU memory, to be written into its own
        memory from the run (Note [Cohort outputs], point 4)."""
        results: list[tuple[PendingBatch, BatchReady | None]] = []
        with self._lock:
            entry.state = "ready"
            entry.descriptors = descriptors
            entry.nbytes = sum(d.nbytes for d in descriptors)
            recipients = [b for b in (entry.producer, *entry.followers) if b is not None]
            entry.followers = []
            self.runs += 1
            private = False
            for batch in recipients:
                member = batch.member
                assert member is not None
                if member.closed or member.job_id not in self.members:
                    continue
                if entry.on_gpu and not _maps_gpu(member):
                    # Its own copy, from the run (as ``take_recipients``): outside the cohort's
                    # memory, so outside its window here; its own memory bounds it.
                    if entry.cost and member.job_id not in entry.charged:
                        self._share_charge(entry, member.job_id)
                    self.served[member.job_id] = self.served.get(member.job_id, 0) + 1
                    self.hits += batch is not entry.producer
                    results.append((batch, None))
                    private = True
                    continue
                if batch is entry.producer:
                    leased = self._lease(entry, member.job_id, settle, batch.batch_id)
                    results.append((batch, self._ready(batch, entry, leased)))
                    continue
                # A hit once it is served (a parked one, by ``_serve`` when it is).
                admit = self._admit(member, batch.batch_id)
                if admit == _PARK:
                    self._park(batch, entry)
                elif admit == _ALONE:
                    if not self._copy(batch, entry):
                        self._to_run.append(batch)
                else:
                    self.hits += 1
                    leased = self._lease(entry, member.job_id, None, batch.batch_id)
                    results.append((batch, self._ready(batch, entry, leased)))
            self.copied += private
            entry.cached = True
            self._cache[id(entry)] = entry
            self._uncache_served()
            self._free_if_done(entry)
        for batch, ready in results:
            if ready is None:
                batch.cohort_entry = None
        self._flush()
        return results

    def take_recipients(self, entry: Entry) -> list[PendingBatch]:
        """The run of ``entry`` cannot go to the cohort's memory: its producer and followers,
        each to be written into its own memory from the run (Note [Cohort outputs], point 4)."""
        with self._lock:
            recipients = [b for b in (entry.producer, *entry.followers) if b is not None]
            entry.followers = []
            for batch in recipients:
                member = batch.member
                if member is None or member.closed or member.job_id not in self.members:
                    continue  # gone: no copy is written for it, so it takes no share
                if entry.cost and member.job_id not in entry.charged:
                    self._share_charge(entry, member.job_id)
            self.copied += 1
            self.runs += 1
            self.hits += len(recipients) - 1
            self._drop(entry)
        for batch in recipients:
            batch.cohort_entry = None
        self._flush()
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
        unknown = []
        settled: list[Settle] = []
        with self._lock:
            if self._device is not None:
                if fence and any(
                    (job_id, region_id) in self._leases
                    and self._leases[(job_id, region_id)].entry.on_gpu
                    for region_id in region_ids
                ):
                    # Before a region can go back: later writes into it wait for the fence,
                    # each member's in turn (Note [GPU output lifetime], point 4).
                    self._device.fence(fence, job_id)
                if closed_slabs:
                    self._device.peer_unmapped(closed_slabs, job_id)
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
        with self._lock:
            self._unpark(job_id)  # its window has room again (after the settles above)
            self._uncache_served()
        self._flush()
        return unknown

    def want(self, job_id: int, batch_id: int) -> None:
        """The trainer of ``job_id`` waits for ``batch_id``: parked, it passes the job's full
        window, or runs for its job alone (Note [Cohort outputs], point 6)."""
        with self._lock:
            self._wanted[job_id] = batch_id
            member = self.members.get(job_id)
            parked = self._parked.get(job_id, {}).pop(batch_id, None)
            if parked is not None and member is not None:
                batch, entry = parked
                entry.parked -= 1
                if self._admit(member, batch_id) == _SERVE:
                    self._serve(batch, entry)
                elif not self._copy(batch, entry):
                    self._to_run.append(batch)
                self._uncache_served()
        self._flush()

    def sender_left(self, job_id: int, first_id: int, end_id: int) -> None:
        """The worker that sent ``job_id``'s batches ``first_id <= id < end_id`` left: its
        leases stop counting in the job's window, its parked batches are dropped (nobody will
        ask for them: point 6 of Note [A job's window] in run_planner.py)."""
        with self._lock:
            for (owner, _), lease in self._leases.items():
                if owner == job_id and lease.counted and first_id <= lease.batch_id < end_id:
                    lease.counted = False
                    self._counted[job_id] -= 1
            parked = self._parked.get(job_id, {})
            for batch_id in [i for i in parked if first_id <= i < end_id]:
                _, entry = parked.pop(batch_id)
                entry.parked -= 1
            self._unpark(job_id)
            self._uncache_served()
        self._flush()

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
                device_bytes=self._device.pool.slab_bytes_total if self._device else 0,
                behind=tuple(sorted(self.behind)),
                behind_runs=self.behind_runs,
            )

    def close(self) -> bool:
        """Closes the cohort's memory (its last member has gone) and frees it, but for GPU
        slabs that members' processes may still map: whether some do (then :meth:`reap` and
        :meth:`free` once ``awaiting_peers`` is false, or at the daemon's exit). Idempotent."""
        with self._lock:
            self._closed = True
            self._by_digest.clear()
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

    def _cache_and_leased(self) -> list[Entry]:
        entries = {id(lease.entry): lease.entry for lease in self._leases.values()}
        entries.update((id(e), e) for e in self._cache.values())
        return list(entries.values())

    def _lease(
        self, entry: Entry, job_id: int, settle: Settle | None, batch_id: int
    ) -> tuple[OutputDescriptor, ...]:
        ids = [next(self._ids) for _ in entry.descriptors]
        # A producer's batch counts in its planner's window until ``settle``; another's here.
        lease = _Lease(entry, job_id, set(ids), settle, batch_id, counted=settle is None)
        for region_id in ids:
            self._leases[(job_id, region_id)] = lease
        if lease.counted:
            self._counted[job_id] += 1
        if entry.cost and job_id not in entry.charged:
            self._share_charge(entry, job_id)
        if self._device is not None and entry.on_gpu:
            # Its trainer maps the slabs from now on: none is freed until it unmapped them.
            self._device.give(job_id, entry.descriptors)
        entry.leases += 1
        self.served[job_id] = self.served.get(job_id, 0) + 1
        return tuple(
            dataclasses.replace(descriptor, region_id=region_id)
            for descriptor, region_id in zip(entry.descriptors, ids, strict=True)
        )

    def _ready(
        self, batch: PendingBatch, entry: Entry, descriptors: tuple[OutputDescriptor, ...]
    ) -> BatchReady:
        member = batch.member
        assert member is not None
        return BatchReady(
            batch.batch_id,
            member.pipeline_id,
            descriptors,
            retired_slabs=self._take_retired(member.job_id),
            event=entry.event if entry.on_gpu else "",
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
        if lease.counted:
            lease.counted = False
            self._counted[lease.job_id] -= 1
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
        for entry in [e for e in self._cache.values() if members <= e.served and not e.parked]:
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
        unserved = set(self.members) - entry.served
        if unserved and entry.state == "ready":
            # Members not served it that submit these inputs later are behind (point 8).
            self._passed[entry.digest] = unserved | self._passed.pop(entry.digest, set())
            while len(self._passed) > _PASSED_KEPT:
                self._passed.popitem(last=False)
        self._cache.pop(id(entry), None)
        entry.cached = False
        if entry.parked:
            # Its outputs go before the members parked on them had room: each runs its own.
            for parked in self._parked.values():
                for batch_id in [i for i, (_, e) in parked.items() if e is entry]:
                    self._to_run.append(parked.pop(batch_id)[0])
            entry.parked = 0
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
        """No batch may match ``entry`` any more: it lets go of its inputs and its producer's
        batch, whose input count goes with them (Note [Cohort outputs], point 7)."""
        entries = self._by_digest.get(entry.digest)
        if entries is not None and entry in entries:
            entries.remove(entry)
            if not entries:
                del self._by_digest[entry.digest]
        entry.inputs = ()
        entry.producer = None

    # --- a member's window (Note [Cohort outputs], point 6) -------------------------------------

    def _admit(self, member: Member, batch_id: int) -> str:
        """Whether ``member`` may be served one more batch now, as its job's window goes: as
        the planner's window (Note [A job's window], points 1 and 2), counting its own runs
        and the batches it was served from the cohort."""
        window = member.executor.window if member.executor is not None else 0
        held = member.held + self._counted[member.job_id]
        if not window or held < window:
            return _SERVE
        if batch_id != self._wanted.get(member.job_id):
            return _PARK
        if held < window + TRAINER_HOLDS + 1:
            return _SERVE
        return _ALONE  # a trainer that keeps its outputs: the run path bounds it

    def _park(self, batch: PendingBatch, entry: Entry) -> None:
        member = batch.member
        assert member is not None
        self._parked[member.job_id][batch.batch_id] = (batch, entry)
        entry.parked += 1

    def _unpark(self, job_id: int) -> None:
        """Serves ``job_id``'s parked batches, oldest first, while its window has room."""
        member = self.members.get(job_id)
        parked = self._parked.get(job_id)
        while member is not None and parked:
            batch_id, (batch, entry) = next(iter(parked.items()))
            if self._admit(member, batch_id) != _SERVE:
                return
            del parked[batch_id]
            entry.parked -= 1
            self._serve(batch, entry)

    def _serve(self, batch: PendingBatch, entry: Entry) -> None:
        """A parked batch, served from ``entry`` now (answered by ``_flush``)."""
        member = batch.member
        assert member is not None
        self.hits += 1
        descriptors = self._lease(entry, member.job_id, None, batch.batch_id)
        self._to_answer.append((batch, self._ready(batch, entry, descriptors)))

    def _copy(self, batch: PendingBatch, entry: Entry) -> bool:
        """A batch past its member's window, served from ``entry`` as private copies rather
        than run again, where its trainer takes copies (point 6); whether it will be. The
        entry stays pinned (a lease of no member) until ``_flush`` has copied its bytes."""
        member = batch.member
        assert member is not None
        if member.outputs.copy_after is None or entry.state != "ready":
            return False  # a trainer that takes no copies: its run waits for its memory
        self.hits += 1
        self.served[member.job_id] = self.served.get(member.job_id, 0) + 1
        if entry.cost and member.job_id not in entry.charged:
            self._share_charge(entry, member.job_id)
        entry.leases += 1
        self._to_copy.append((batch, entry))
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
                entry.leases -= 1
                self._free_if_done(entry)
                self._fit_window()
            retired = self._take_retired(member.job_id) + member.outputs.take_retired()
        return BatchReady(
            batch.batch_id,
            member.pipeline_id,
            descriptors,
            retired_slabs=retired,
            event=event,
            copies=copies,
        )

    def _rank(self, job_id: int, behind: bool) -> None:
        """``job_id`` is behind the window now, or not (point 8); told to the scheduler by
        ``_flush``, on a change only."""
        if behind == (job_id in self.behind):
            return
        if behind:
            self.behind.add(job_id)
            log.info(
                "cohort %r: job %d trails past the window; its runs rank behind", self.name, job_id
            )
        else:
            self.behind.discard(job_id)
            log.info("cohort %r: job %d is back within the window", self.name, job_id)
        self._ranks.append((job_id, behind))

    def _share_charge(self, entry: Entry, job_id: int) -> None:
        """``job_id`` consumed the run of ``entry`` too: the run's cost, split once more, the
        others' share taken back (Note [Cohort outputs], point 5)."""
        before = len(entry.charged)
        after = before + 1
        for payer in entry.charged if before else ():
            self._charges.append((payer, entry.cost / after - entry.cost / before, True))
        self._charges.append((job_id, entry.cost / after, True))
        entry.charged.append(job_id)

    def _flush(self) -> None:
        """What the lock's holders left to do outside it: charges, answers, runs."""
        with self._lock:
            charges, self._charges = self._charges, []
            answers, self._to_answer = self._to_answer, []
            to_copy, self._to_copy = self._to_copy, []
            to_run, self._to_run = self._to_run, []
            ranks, self._ranks = self._ranks, []
        for job_id, behind in ranks:
            self._behind(job_id, behind)
        for job_id, seconds, tag in charges:
            (self._share if tag else self._charge)(job_id, seconds)
        for batch, entry in to_copy:
            copied = self._copied(batch, entry)
            if copied is not None:
                answers.append((batch, copied))
        for batch, ready in answers:
            member = batch.member
            if member is not None and not member.closed:
                member.answer(batch, ready)
        for batch in to_run:
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
