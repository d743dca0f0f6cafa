"""The cache of a cohort's shared runs (docs/design/cohort-outputs.md, "The cache"): the
entries a member's batch may match, the ready ones kept for members not served yet, within
``window_bytes`` of outputs held for trailing members only, and the digests of those that left
unserved, which tell a member behind from one ahead. Not locked: its cohort calls it under the
cohort's lock."""

from __future__ import annotations

import collections
from collections.abc import Collection

from dalid.protocol import OutputDescriptor

from ..outputs.job_outputs import JobOutputs
from .cohort_entries import Entry, EntryState

# How many digests of entries that left the cache unserved are kept: some 40 bytes each, and
# more than any window holds batches.
PASSED_KEPT = 4096


class CohortCache:
    """A cohort's entries by digest, its ready entries in the order they were cached, and the
    digests of entries that left unserved. ``outputs``: the cohort's memory, where an entry's
    regions go back once it is done."""

    def __init__(self, outputs: JobOutputs, window_bytes: int) -> None:
        self.outputs = outputs
        self.window_bytes = window_bytes
        self.dropped = 0  # entries that left before every member was served them
        self._by_digest: dict[bytes, list[Entry]] = {}
        self._cached: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        # The members not served each entry that left the cache unserved, by its digest.
        self._passed: collections.OrderedDict[bytes, set[int]] = collections.OrderedDict()

    def matching(self, digest: bytes) -> list[Entry]:
        """The entries of inputs with this digest (their bytes still to compare)."""
        return list(self._by_digest.get(digest, ()))

    def pending(self) -> list[Entry]:
        """The entries whose run is queued or running."""
        entries = (e for es in self._by_digest.values() for e in es)
        return [entry for entry in entries if entry.state is EntryState.PENDING]

    def add(self, entry: Entry) -> None:
        """A new entry, to run: members' batches of the same inputs match it from now on."""
        self._by_digest.setdefault(entry.digest, []).append(entry)

    def ready(self, entry: Entry, descriptors: tuple[OutputDescriptor, ...]) -> None:
        """The run of ``entry`` is in the cohort's memory, at ``descriptors``."""
        entry.state = EntryState.READY
        entry.descriptors = descriptors
        entry.nbytes = sum(d.nbytes for d in descriptors)

    def keep(self, entry: Entry) -> None:
        """Keeps a ready entry for the members not served it yet."""
        entry.cached = True
        self._cached[id(entry)] = entry

    def trails(self, digest: bytes, job_id: int) -> bool:
        """Whether ``job_id`` submits inputs whose entry left the cache before it was served
        them (it is behind); the digest no longer tells so for it afterwards."""
        passed = self._passed.get(digest)
        if passed is None or job_id not in passed:
            return False
        passed.discard(job_id)
        if not passed:
            del self._passed[digest]
        return True

    def held_bytes(self) -> int:
        """The bytes of cached outputs no member holds a lease of."""
        return sum(e.nbytes for e in self._cached.values() if not e.leases)

    def entries(self) -> list[Entry]:
        return list(self._cached.values())

    # --- entries that leave: each returns those that left the cache ------------------------------

    def uncache_served(self, members: Collection[int]) -> list[Entry]:
        """Entries every member has been served leave the cache, then those past the window."""
        everyone = set(members)
        gone = [e for e in self._cached.values() if everyone <= e.served and not e.parked]
        for entry in gone:
            self._uncache(entry, everyone)
        return gone + self.fit_window(everyone)

    def fit_window(self, members: Collection[int]) -> list[Entry]:
        """The oldest outputs held only for trailing members go, past ``window_bytes``."""
        held = self.held_bytes()
        gone = []
        for entry in list(self._cached.values()):
            if held <= self.window_bytes:
                break
            if not entry.leases:
                held -= entry.nbytes
                self.dropped += 1
                self._uncache(entry, set(members))
                gone.append(entry)
        return gone

    def evict_oldest(self, members: Collection[int]) -> Entry | None:
        """Drops the oldest cached outputs no member holds, to make room: the one that went."""
        for entry in list(self._cached.values()):
            if not entry.leases:
                self.dropped += 1
                self._uncache(entry, set(members))
                return entry
        return None

    def _uncache(self, entry: Entry, members: set[int]) -> None:
        unserved = members - entry.served
        if unserved and entry.state is EntryState.READY:
            # Members not served it that submit these inputs later are behind.
            self._passed[entry.digest] = unserved | self._passed.pop(entry.digest, set())
            while len(self._passed) > PASSED_KEPT:
                self._passed.popitem(last=False)
        self._cached.pop(id(entry), None)
        entry.cached = False
        self.forget(entry)
        self.free_if_done(entry)

    def free_if_done(self, entry: Entry) -> None:
        """A ready entry out of the cache that no member leases: its regions go back."""
        if entry.state is EntryState.READY and not entry.cached and not entry.leases:
            entry.state = EntryState.GONE
            self.outputs.release([d.region_id for d in entry.descriptors])

    def drop(self, entry: Entry) -> None:
        """An entry whose run is shared with no one (it failed, or went elsewhere)."""
        entry.state = EntryState.GONE
        self.forget(entry)

    def forget(self, entry: Entry) -> None:
        """No batch may match ``entry`` any more: it lets go of its inputs and its producer's
        batch, whose input count goes with them (docs/design/cohort-outputs.md, "Inputs")."""
        entries = self._by_digest.get(entry.digest)
        if entries is not None and entry in entries:
            entries.remove(entry)
            if not entries:
                del self._by_digest[entry.digest]
        entry.inputs = ()
        entry.producer = None

    def clear(self) -> None:
        self._by_digest.clear()
        self._cached.clear()
