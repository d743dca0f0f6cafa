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
cache unserved is behind, and ranks so. Why and the tests: docs/design/cohort-outputs.md.

Here is the thread-safe cohort: its lock, and what its callers' threads do outside it (answers,
charges, private copies, batches run again). What it does under the lock is
``cohort_state.py``, over its parts: the cache of shared runs (``cohort_cache.py``), leases and
the GPU slabs members map (``cohort_leases.py``), each member's window (``cohort_windows.py``),
the split of a run's charge (``cohort_charges.py``) and its figures (``cohort_figures.py``).
The daemon's cohorts by name, and who may join one, are ``cohort_registry.py``; how batches are
compared, ``cohort_matching.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from dalid.protocol import BatchFailed, BatchReady, CohortStatus, ErrorCode, OutputDescriptor

from ..outputs.job_outputs import JobOutputs
from ..outputs.pool import PoolClosed, PoolFull
from ..outputs.run_output import OutputFailure, RunOutput
from .cohort_charges import Charge, no_charge
from .cohort_entries import Entry, Outcome, Settle
from .cohort_leases import COHORT_REGION_BASE, Alive
from .cohort_matching import batch_digest
from .cohort_state import CohortState

if TYPE_CHECKING:
    from .runs import Member, PendingBatch

__all__ = [
    "COHORT_REGION_BASE",
    "Alive",
    "Charge",
    "Cohort",
    "Entry",
    "Outcome",
    "Rank",
    "no_charge",
    "no_rank",
    "resubmit",
]

# rank(job_id, behind): a member fell past the window, or is back (FairScheduler.set_behind).
Rank = Callable[[int, bool], None]


def no_rank(job_id: int, behind: bool) -> None:
    pass


class Cohort:
    """The members of one cohort, its entries and the memory their outputs live in.

    Thread-safe: the I/O thread submits, releases and removes members; executor threads write
    and publish runs. ``outputs``: the cohort's own output memory; ``window_bytes``: the most
    bytes of outputs held for trailing members only; ``alive`` tells whether a trainer process
    lives (pid, pid namespace); ``charge`` counts a share of a run to a job, ``share`` moves
    its fair-share tag too, ``behind`` ranks a member past the window.
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
        self._charge = charge
        self._share = share
        self._behind = behind
        self._lock = threading.Lock()
        self._state = CohortState(self, name, outputs, window_bytes, alive)

    @property
    def members(self) -> dict[int, Member]:
        return self._state.members

    @property
    def window_bytes(self) -> int:
        return self._state.window_bytes

    # --- members --------------------------------------------------------------------------------

    def join(self, member: Member) -> None:
        with self._lock:
            self._state.join(member)
        member.cohort = self

    def leave(self, member: Member, pid: int, namespace: int) -> None:
        """``member``'s job ended (its executor has let it go): its followers and queued runs
        pass to other members, its leases end now or with its trainer process."""
        # A pipeline of the job's own stopped with it, dropping the runs it held; a shared one
        # still delivers those it took (the others see them published).
        stopped = member.executor is None or not member.executor.members
        with self._lock:
            again = self._state.leave(member, pid, namespace, stopped)
        resubmit(again)
        self._flush()

    def reap(self) -> None:
        """Ends the leases of members gone whose trainer process has exited since, and lets
        the cohort's GPU slabs they mapped go."""
        with self._lock:
            self._state.reap()

    def peer_leaving(self, job_id: int, kept_slabs: Sequence[str]) -> None:
        """The trainer of member ``job_id`` said goodbye: it maps ``kept_slabs`` still, and no
        other slab of the cohort's GPU memory (Note [GPU output lifetime] in cuda.py)."""
        self._state.leases.peer_leaving(job_id, kept_slabs)

    @property
    def awaiting_peers(self) -> bool:
        """Whether GPU slabs of the closed cohort wait for members' processes to unmap them."""
        return self._state.leases.awaiting_peers

    @property
    def empty(self) -> bool:
        return not self._state.members

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
            taken = self._state.take(batch, member, digest)
        self._flush()
        return taken

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
                    evicted = self._state.evict_oldest()
                self._flush()  # batches parked on what went run for their own jobs
                if not evicted:
                    return None
            except (OutputFailure, PoolClosed):
                return None

    def account(self, entry: Entry, seconds: float) -> None:
        """Charges ``seconds`` of service, the run of ``entry``, split among the jobs that
        consume it: its producer now, the others as they are given its outputs."""
        with self._lock:
            self._state.account(entry, seconds)
        self._flush()

    def publish(
        self, entry: Entry, descriptors: tuple[OutputDescriptor, ...], settle: Settle
    ) -> list[tuple[PendingBatch, BatchReady | None]]:
        """The run of ``entry`` is in the cohort's memory: the results for its producer (whose
        window ``settle`` frees once its trainer released them) and its followers; None for
        one whose trainer cannot map the cohort's GPU memory, to be written into its own
        memory from the run."""
        with self._lock:
            results = self._state.publish(entry, descriptors, settle)
        self._flush()
        return results

    def take_recipients(self, entry: Entry) -> list[PendingBatch]:
        """The run of ``entry`` cannot go to the cohort's memory: its producer and followers,
        each to be written into its own memory from the run."""
        with self._lock:
            recipients = self._state.take_recipients(entry)
        self._flush()
        return recipients

    def abandon(self, entry: Entry) -> list[PendingBatch]:
        """The run of ``entry`` failed or had bad samples: nothing of it is shared; its
        followers, to run for themselves."""
        with self._lock:
            return self._state.abandon(entry)

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
        with self._lock:
            unknown, settled = self._state.release(job_id, region_ids, fence, closed_slabs)
        for settle in settled:
            settle()
        with self._lock:
            self._state.released(job_id)  # its window has room again (after the settles)
        self._flush()
        return unknown

    def want(self, job_id: int, batch_id: int) -> None:
        """The trainer of ``job_id`` waits for ``batch_id``: parked, it passes the job's full
        window, or runs for its job alone."""
        with self._lock:
            self._state.want(job_id, batch_id)
        self._flush()

    def sender_left(self, job_id: int, first_id: int, end_id: int) -> None:
        """The worker that sent ``job_id``'s batches ``first_id <= id < end_id`` left: its
        leases stop counting in the job's window, its parked batches are dropped (nobody will
        ask for them: Note [A job's window])."""
        with self._lock:
            self._state.sender_left(job_id, first_id, end_id)
        self._flush()

    def take_retired(self, job_id: int) -> tuple[str, ...]:
        """The cohort's slabs freed since ``job_id`` last heard, for its trainer to unmap."""
        with self._lock:
            return self._state.leases.take_retired(job_id)

    # --- figures, the end -----------------------------------------------------------------------

    def status(self) -> CohortStatus:
        with self._lock:
            return self._state.status()

    def close(self) -> bool:
        """Closes the cohort's memory (its last member has gone) and frees it, but for GPU
        slabs that members' processes may still map: whether some do (then :meth:`reap` and
        :meth:`free` once ``awaiting_peers`` is false, or at the daemon's exit). Idempotent."""
        with self._lock:
            self._state.clear()
        if self.outputs.close():
            return True
        self.outputs.free()
        return False

    def free(self) -> None:
        """Frees all the cohort's memory, what members' processes still map included."""
        self.outputs.close()
        self.outputs.free()

    # --- outside the lock -----------------------------------------------------------------------

    def _copied(self, batch: PendingBatch, entry: Entry) -> BatchReady | None:
        """The private copies a batch past its window was promised, read from ``entry``; None
        if the cohort closed meanwhile (its last member, this one, left). Under the lock, so
        that ``close`` cannot unmap the regions while they are read: one batch's copy, not a
        run."""
        member = batch.member
        assert member is not None
        with self._lock:
            if self._state.closed:
                return None
            try:
                # GPU outputs into the member's copy memory, on its stream: no host wait here.
                descriptors, copies, event = member.outputs.copies_from(
                    self.outputs, entry.descriptors
                )
            finally:
                self._state.copied(entry)
            retired = self._state.leases.take_retired(member.job_id)
            retired += member.outputs.take_retired()
        return BatchReady(
            batch.batch_id,
            member.pipeline_id,
            descriptors,
            retired_slabs=retired,
            event=event,
            copies=copies,
        )

    def _flush(self) -> None:
        """What the lock's holders left to do outside it: ranks, charges, answers, runs."""
        with self._lock:
            outbox = self._state.take_outbox()
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
        resubmit(outbox.runs)


def resubmit(batches: Sequence[PendingBatch]) -> None:
    """Batches that waited for a run they no longer get: each runs for its own job."""
    for batch in batches:
        member = batch.member
        if member is None or member.closed:
            continue
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
            continue
        member.executor.submit(batch)


def _on_gpu(output: RunOutput) -> bool:
    return type(output.tensors).__name__.endswith("GPU")
