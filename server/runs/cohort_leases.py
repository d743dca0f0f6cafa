"""Members' leases of a cohort's regions, and the cohort's GPU slabs each member's process maps
(docs/design/cohort-outputs.md, "Where" and "Leases"). Not locked: its cohort calls it under the
cohort's lock."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dalid.protocol import OutputDescriptor

from ..outputs.cuda_store import CudaStore
from ..outputs.job_outputs import JobOutputs
from .cohort_entries import Entry, Settle

# Region ids of cohort leases start here; a job's own regions count from 1 and never get there.
COHORT_REGION_BASE = 1 << 48

# alive(pid, pid namespace): whether a trainer process lives.
Alive = Callable[[int, int], bool]


@dataclass(eq=False)
class Lease:
    """One member's lease of an entry's regions: the ids it was given, not yet released."""

    entry: Entry
    job_id: int
    remaining: set[int]
    settle: Settle | None = None
    batch_id: int = 0
    # Counts in its job's window: a hit's or a follow's lease, until released or its worker
    # left; a producer's counts in the planner's window instead (until ``settle``).
    counted: bool = False


class CohortLeases:
    """The leases of a cohort's members, by (job, region id), and the GPU slabs their trainers
    map. ``outputs``: the cohort's memory; on a GPU daemon its device store knows each member
    as a peer (Note [GPU output lifetime] in cuda.py)."""

    def __init__(self, outputs: JobOutputs) -> None:
        self.outputs = outputs
        self.device = next((s for s in outputs.stores if isinstance(s, CudaStore)), None)
        if self.device is not None:
            self.device.for_members()
        self._leases: dict[tuple[int, int], Lease] = {}
        self._ids = itertools.count(COHORT_REGION_BASE)
        self._counted: collections.Counter[int] = collections.Counter()
        # Members gone whose trainer process still lives: leases kept, slabs mapped.
        self._lingering: dict[int, tuple[int, int]] = {}
        self._mapping: dict[int, tuple[int, int]] = {}
        # The cohort's slabs freed since each member last heard, for its trainer to unmap.
        self._retired: dict[int, list[str]] = {}

    def join(self, job_id: int) -> None:
        self._retired.setdefault(job_id, [])

    def counted(self, job_id: int) -> int:
        """How many of ``job_id``'s leases count in its window."""
        return self._counted[job_id]

    def lease(
        self, entry: Entry, job_id: int, settle: Settle | None, batch_id: int
    ) -> tuple[OutputDescriptor, ...]:
        """Leases ``entry``'s regions to ``job_id``, under ids of its own: the descriptors."""
        ids = [next(self._ids) for _ in entry.descriptors]
        # A producer's batch counts in its planner's window until ``settle``; another's here.
        lease = Lease(entry, job_id, set(ids), settle, batch_id, counted=settle is None)
        for region_id in ids:
            self._leases[(job_id, region_id)] = lease
        if lease.counted:
            self._counted[job_id] += 1
        if self.device is not None and entry.on_gpu:
            # Its trainer maps the slabs from now on: none is freed until it unmapped them.
            self.device.give(job_id, entry.descriptors)
        entry.leases += 1
        return tuple(
            dataclasses.replace(descriptor, region_id=region_id)
            for descriptor, region_id in zip(entry.descriptors, ids, strict=True)
        )

    @staticmethod
    def pin(entry: Entry) -> None:
        """Keeps ``entry``'s regions while a private copy is read from them (a lease of no
        member); ``unpin`` ends it."""
        entry.leases += 1

    @staticmethod
    def unpin(entry: Entry) -> None:
        entry.leases -= 1

    def release(
        self, job_id: int, region_ids: Sequence[int], fence: str, closed_slabs: Sequence[str]
    ) -> tuple[list[int], list[Lease]]:
        """Ends ``job_id``'s leases of these region ids after its release ``fence``: the ids
        not leased, and the leases now fully released (for ``end``, in order). Raises
        ReleaseRefused for a fence that cannot be used."""
        if self.device is not None:
            if fence and any(
                (job_id, region_id) in self._leases
                and self._leases[(job_id, region_id)].entry.on_gpu
                for region_id in region_ids
            ):
                # Before a region can go back: later writes into it wait for the fence, each
                # member's in turn (Note [GPU output lifetime] in cuda.py).
                self.device.fence(fence, job_id)
            if closed_slabs:
                self.device.peer_unmapped(closed_slabs, job_id)
        unknown, done = [], []
        for region_id in region_ids:
            lease = self._leases.pop((job_id, region_id), None)
            if lease is None:
                unknown.append(region_id)
                continue
            lease.remaining.discard(region_id)
            if not lease.remaining:
                done.append(lease)
        return unknown, done

    def end(self, lease: Lease) -> Settle | None:
        """A lease is over: its entry has one lease fewer; what frees its job's window, if
        anything does."""
        lease.entry.leases -= 1
        if lease.counted:
            lease.counted = False
            self._counted[lease.job_id] -= 1
        return lease.settle

    def leave(self, job_id: int, pid: int, namespace: int, alive: Alive) -> list[Lease]:
        """Member ``job_id``'s job ended: its leases end now, or with its trainer process if it
        lives (``reap``). The leases ended now, to ``end`` before ``unmap_gone``."""
        self._retired.pop(job_id, None)
        if not any(key[0] == job_id for key in self._leases):
            return []
        if pid > 0 and alive(pid, namespace):
            self._lingering[job_id] = (pid, namespace)
            return []
        return self._take_leases_of(job_id)

    def unmap_gone(self, job_id: int, pid: int, namespace: int, alive: Alive) -> None:
        """Member ``job_id``'s job ended: its fences go, and the GPU slabs it mapped are let go
        of now if its process is gone, else once it is (``reap``)."""
        if self.device is None:
            return
        self.device.forget_fences(job_id)  # while its trainer may still have them
        if self.device.maps(job_id):
            if pid > 0 and not alive(pid, namespace):
                self.device.peer_gone(job_id)  # what it mapped went with its process
            else:
                # Its slabs not kept at its goodbye were let go of then (``peer_leaving``); a
                # process the daemon cannot watch keeps the rest until the daemon exits.
                self._mapping[job_id] = (pid, namespace)

    def reap(self, alive: Alive) -> list[Lease]:
        """Ends the leases of members gone whose trainer process has exited since: the leases
        ended, to ``end`` before ``reap_mappings``."""
        ended: list[Lease] = []
        for job_id, (pid, namespace) in list(self._lingering.items()):
            if not alive(pid, namespace):
                del self._lingering[job_id]
                ended += self._take_leases_of(job_id)
        return ended

    def reap_mappings(self, alive: Alive) -> None:
        """Lets the GPU slabs go that members gone mapped, once their process has exited."""
        for job_id, (pid, namespace) in list(self._mapping.items()):
            if pid > 0 and not alive(pid, namespace):
                del self._mapping[job_id]
                if self.device is not None:
                    self.device.peer_gone(job_id)

    def _take_leases_of(self, job_id: int) -> list[Lease]:
        ended = {id(lease): lease for key, lease in self._leases.items() if key[0] == job_id}
        for key in [key for key in self._leases if key[0] == job_id]:
            del self._leases[key]
        for lease in ended.values():
            lease.settle = None  # its job is gone: no window to free
        return list(ended.values())

    def sender_left(self, job_id: int, first_id: int, end_id: int) -> None:
        """The leases of batches ``first_id <= id < end_id`` of ``job_id`` stop counting in its
        window (their worker left)."""
        for (owner, _), lease in self._leases.items():
            if owner == job_id and lease.counted and first_id <= lease.batch_id < end_id:
                lease.counted = False
                self._counted[job_id] -= 1

    def take_retired(self, job_id: int) -> tuple[str, ...]:
        """The cohort's slabs freed since ``job_id`` last heard, for its trainer to unmap."""
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

    def entries(self) -> list[Entry]:
        """The entries some member leases."""
        return list({id(lease.entry): lease.entry for lease in self._leases.values()}.values())

    def peer_leaving(self, job_id: int, kept_slabs: Sequence[str]) -> None:
        if self.device is not None:
            self.device.peer_leaving(kept_slabs, job_id)

    @property
    def awaiting_peers(self) -> bool:
        return self.device is not None and self.device.awaiting_peers

    @property
    def device_bytes(self) -> int:
        return self.device.pool.slab_bytes_total if self.device is not None else 0

    def clear(self) -> None:
        self._leases.clear()
