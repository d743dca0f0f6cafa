"""A bounded pool of output regions carved from reusable slabs, one pool per job.

Note [Output buffer lifetime]
-----------------------------
A job's output store creates each slab once and keeps it while the job lives; a region is leased
from ``allocate`` until the trainer releases it, and from ``batch_ready`` on only the trainer may
end that lease. With no room, ``allocate`` waits for releases (a pool with a ``growth`` first
grows while its reservation allows), and never past the pool's limit. Empty slabs are retired,
smallest first, for a larger slab or once no lease needed them for ``IDLE_SLAB_S``, and their
names handed to the trainer; when the job ends every slab is unmapped and unlinked, and a
trainer's own mapping keeps the pages it still views. GPU regions keep Note [GPU output
lifetime] beside this. docs/design/output-buffers.md
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

ALIGNMENT = 256
PAGE = mmap.PAGESIZE
# A slab of a growing pool holds at most this many regions of the size that asked for it (and
# what fits in ``slab_bytes``): small outputs get small slabs, and room for a few batches.
GROWTH_REGIONS = 4
# How long an empty slab may stay beyond what the pool's leases needed at once.
IDLE_SLAB_S = 30.0


class Slab(Protocol):
    """One block of memory the daemon made and exports; ``close()`` is idempotent and frees it
    (``unmap=False``: only its name, for a writer that could not be stopped)."""

    name: str
    size: int

    def address(self, offset: int) -> int: ...

    def copy_into(self, offset: int, source: Any) -> None: ...

    def close(self, unmap: bool = True) -> None: ...


class SlabBackend(Protocol):
    """Makes the slabs of one kind of memory (shared memory in ``shm.py``, device memory in
    ``cuda.py``)."""

    def create(self, name: str, size: int) -> Slab: ...


class Growth(Protocol):
    """How far a pool may raise its limit before it waits: ``bytes`` reserved so far, at most
    ``cap``."""

    bytes: int
    cap: int

    def grow(self, nbytes: int) -> bool: ...

    def available(self) -> int:
        """How much more it could reserve now."""

    def refusal(self, nbytes: int) -> str: ...

    def close(self) -> None: ...


class PoolTooSmall(ValueError):
    """A batch needs more output memory than the whole pool may hold."""


class PoolClosed(RuntimeError):
    """The pool was closed while an allocation waited."""


class SlabUnavailable(RuntimeError):
    """The memory for a new slab could not be had (``/dev/shm`` is full, say): the batch that
    asked for it fails, and the pool is as it was."""


class PoolFull(RuntimeError):
    """The pool stayed full, with nothing released, for as long as the allocation would wait
    (Note [Private copies] in ``copies.py``)."""


@dataclass(frozen=True)
class Region:
    region_id: int
    slab: Slab
    offset: int
    nbytes: int


def _align(size: int, alignment: int) -> int:
    return max(alignment, -(-size // alignment) * alignment)


class _SlabSpace:
    """First-fit free list of one slab, with neighbours merged on free."""

    def __init__(self, slab: Slab) -> None:
        self.slab = slab
        self.free: list[tuple[int, int]] = [(0, slab.size)]  # (offset, size), sorted by offset
        self.leased = 0

    def fit(self, size: int) -> int | None:
        """The index of the smallest free block that holds ``size`` bytes, or None."""
        best: int | None = None
        for index, (_, free_size) in enumerate(self.free):
            if free_size >= size and (best is None or free_size < self.free[best][1]):
                best = index
        return best

    def take(self, size: int, index: int | None = None) -> int | None:
        """Leases ``size`` bytes from the free block ``index`` (the best fit if None)."""
        if index is None:
            index = self.fit(size)
            if index is None:
                return None
        offset, free_size = self.free[index]
        if free_size == size:
            del self.free[index]
        else:
            self.free[index] = (offset + size, free_size - size)
        self.leased += 1
        return offset

    def give_back(self, offset: int, size: int) -> None:
        index = bisect.bisect_left(self.free, (offset, 0))
        self.free.insert(index, (offset, size))
        # Merge with the following, then with the preceding free block.
        if index + 1 < len(self.free) and offset + size == self.free[index + 1][0]:
            size += self.free.pop(index + 1)[1]
            self.free[index] = (offset, size)
        if index > 0 and self.free[index - 1][0] + self.free[index - 1][1] == offset:
            previous_offset, previous_size = self.free.pop(index - 1)
            self.free[index - 1] = (previous_offset, previous_size + size)
        self.leased -= 1

    @property
    def empty(self) -> bool:
        return self.leased == 0


class RegionPool:
    """Output regions for one job, at most ``limit_bytes`` of slabs of ``slab_bytes`` or more.

    Thread-safe: executors allocate from their threads while the I/O thread releases. Pools of
    one job pass the same ``region_ids`` so that their ids never collide. A pool given a growth
    (:meth:`grow_within`) holds what the growth reserves, and closes it when it closes.
    """

    def __init__(
        self,
        backend: SlabBackend,
        name_prefix: str,
        limit_bytes: int,
        slab_bytes: int,
        alignment: int = ALIGNMENT,
        *,
        region_ids: Iterator[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend = backend
        self._growth: Growth | None = None
        self._name_prefix = name_prefix
        self.limit_bytes = limit_bytes
        self.slab_bytes = _align(slab_bytes, PAGE)
        self._alignment = alignment
        self._spaces: list[_SlabSpace] = []
        self._leases: dict[int, tuple[_SlabSpace, int, int]] = {}
        # itertools.count is atomic in CPython, so pools may share one across threads.
        self._region_ids = region_ids if region_ids is not None else itertools.count(1)
        self._next_slab_number = 0
        # The most bytes of slabs the pool has held at once.
        self.peak_slab_bytes = 0
        self._condition = threading.Condition()
        self._closed = False
        self._retired: list[str] = []
        # Regions released so far, and that count when an allocation last gave up waiting: until
        # it changes, the trainer holds everything and the next allocation gives up at once.
        self._released = 0
        self._gave_up_at = -1
        # Bytes leased now, the most leased at once since the last trim, and when the next is
        # (idle slabs: Note [Output buffer lifetime]).
        self._clock = clock
        self._leased_bytes = 0
        self._most_leased = 0
        self._trim_at = clock() + IDLE_SLAB_S

    def grow_within(self, growth: Growth) -> None:
        """From now on ``limit_bytes`` is what ``growth`` has reserved, raised as outputs need
        room, at most to its cap; for a pool that has made no slab yet."""
        with self._condition:
            if self._spaces:
                raise RuntimeError("a pool takes its growth before it makes a slab")
            self._growth = growth
            self.limit_bytes = growth.bytes

    def hold_sets(self, sizes: Sequence[int], sets: int) -> None:
        """Raises the pool's limit, where it is lower, to hold ``sets`` sets of regions of
        ``sizes`` at once, each set in a slab of its own (the memory of a job's private copies
        kept on the device: Note [Private copies] in copies.py)."""
        per_set = _align(sum(_align(size, self._alignment) for size in sizes), PAGE)
        with self._condition:
            self.limit_bytes = max(self.limit_bytes, sets * per_set)
            self.slab_bytes = max(self.slab_bytes, per_set)

    @property
    def slab_bytes_total(self) -> int:
        return sum(space.slab.size for space in self._spaces)

    @property
    def leased_bytes(self) -> int:
        # Without the lock: ``dalid status`` reads it on the I/O thread, and an executor holds
        # the lock while it makes or frees a slab (a file of tens of MB allocated or unmapped).
        return self._leased_bytes

    @property
    def leased_regions(self) -> int:
        return len(self._leases)

    @property
    def slab_count(self) -> int:
        return len(self._spaces)

    def allocate(
        self,
        sizes: Sequence[int],
        cancelled: Callable[[], bool] = lambda: False,
        poll_interval: float = 0.05,
        give_up_after: float | None = None,
    ) -> list[Region]:
        """One region per size, all or none; blocks while the pool is full.

        Raises :class:`PoolTooSmall` when the sizes could never fit, :class:`SlabUnavailable`
        when the memory of a slab they need cannot be had now, and :class:`PoolClosed`
        when the pool closes or ``cancelled()`` turns true while waiting. With
        ``give_up_after``, raises :class:`PoolFull` once no region has been released for that
        many seconds while the sizes do not fit, and at once while nothing was released since
        the last time it did.
        """
        aligned = [_align(size, self._alignment) for size in sizes]
        if self._growth is not None and sum(aligned) > self._growth.cap:
            raise PoolTooSmall(self._growth.refusal(sum(aligned)))
        if self._growth is None and sum(aligned) > self.limit_bytes:
            raise self._too_small(aligned)
        with self._condition:
            if self._clock() >= self._trim_at:
                self._trim()
            released = self._released
            deadline = None if give_up_after is None else time.monotonic() + give_up_after
            while True:
                if self._closed or cancelled():
                    raise PoolClosed("the output pool was closed")
                regions = self._try_allocate(aligned, sizes)
                if regions is not None:
                    return regions
                if not self._leases:
                    # Nothing will be released: lay the pool out afresh, and if the batch
                    # still does not fit, it never will.
                    self._drop_empty_slabs()
                    regions = self._try_allocate(aligned, sizes)
                    if regions is not None:
                        return regions
                    if self._growth is not None:
                        raise PoolTooSmall(self._growth.refusal(sum(aligned)))
                    raise self._too_small(aligned)
                if deadline is not None:
                    if self._released != released:
                        released = self._released
                        deadline = time.monotonic() + (give_up_after or 0.0)
                    if self._released == self._gave_up_at or time.monotonic() >= deadline:
                        self._gave_up_at = self._released
                        raise PoolFull(
                            f"the job's {self.limit_bytes} bytes of output memory are all held"
                        )
                self._condition.wait(poll_interval)

    def _too_small(self, aligned: Sequence[int]) -> PoolTooSmall:
        return PoolTooSmall(
            f"a batch needs {sum(aligned)} bytes of output memory in {len(aligned)} regions, more "
            f"than fits in the pool's limit of {self.limit_bytes} bytes: raise --pool-bytes or "
            "use a smaller batch"
        )

    def _trim(self) -> None:
        """Frees the empty slabs, largest first, that the most bytes leased at once since the
        last trim did not need (Note [Output buffer lifetime]); under the lock."""
        spare = self.slab_bytes_total - self._most_leased
        empty = sorted((s for s in self._spaces if s.empty), key=lambda s: -s.slab.size)
        for space in empty:
            if space.slab.size <= spare:
                spare -= space.slab.size
                self._retire(space)
        self._most_leased = self._leased_bytes
        self._trim_at = self._clock() + IDLE_SLAB_S

    def _drop_empty_slabs(self) -> None:
        for space in [space for space in self._spaces if space.empty]:
            self._retire(space)

    def _retire(self, space: _SlabSpace) -> None:
        self._spaces.remove(space)
        space.slab.close()
        self._retired.append(space.slab.name)

    def has_room(self, sizes: Sequence[int]) -> bool:
        """Whether regions of ``sizes`` fit in what the pool may still lease, now (free
        space may be split, so ``allocate`` can still wait: an estimate for not waiting)."""
        needed = sum(_align(size, self._alignment) for size in sizes)
        with self._condition:
            leased = sum(size for _, _, size in self._leases.values())
            growth = self._growth.available() if self._growth is not None else 0
        return needed <= self.limit_bytes - leased + growth

    def sets_fit(self, sizes: Sequence[int]) -> int:
        """How many sets of regions of ``sizes`` the pool could hold at once: what it may reach
        (its limit, and what its growth may still reserve) over what a set takes of it, each
        region counted in whole pages (a large one gets a slab of its own). Errs low: small
        regions share slabs."""
        needed = sum(_align(size, PAGE) for size in sizes)
        with self._condition:
            reach = self.limit_bytes
            if self._growth is not None:
                reach += self._growth.available()
        return reach // needed if needed else reach

    def release(self, region_ids: Sequence[int]) -> list[int]:
        """Ends the leases of ``region_ids``; returns the ids that were not leased."""
        unknown = []
        with self._condition:
            for region_id in region_ids:
                lease = self._leases.pop(region_id, None)
                if lease is None:
                    unknown.append(region_id)
                    continue
                space, offset, size = lease
                space.give_back(offset, size)
                self._leased_bytes -= size
            self._released += len(region_ids) - len(unknown)
            self._condition.notify_all()
        return unknown

    def address(self, region_id: int) -> int:
        """Where a leased region starts, in the daemon's mapping of its slab."""
        with self._condition:
            space, offset, _ = self._leases[region_id]
            return space.slab.address(offset)

    def take_retired(self) -> list[str]:
        """Names of the slabs freed since the last call, for the trainer to unmap."""
        with self._condition:
            retired, self._retired = self._retired, []
        return retired

    def close(self, unmap: bool = True) -> None:
        """Frees every slab (see the note above); waiting allocations raise PoolClosed.

        ``unmap=False`` only unlinks the names, for when a thread that may still write into
        the slabs could not be stopped: unmapping under it would crash the daemon.
        """
        with self._condition:
            if self._closed:
                return
            self._closed = True
            spaces, self._spaces = self._spaces, []
            self._leases.clear()
            self._leased_bytes = 0
            self._condition.notify_all()
        for space in spaces:
            space.slab.close(unmap=unmap)
        if self._growth is not None:
            self._growth.close()

    def _try_allocate(self, aligned: Sequence[int], sizes: Sequence[int]) -> list[Region] | None:
        taken: list[tuple[_SlabSpace, int, int]] = []
        try:
            for size in aligned:
                placed = self._place(size)
                if placed is None:
                    self._give_back(taken)
                    return None
                taken.append((placed[0], placed[1], size))
        except BaseException:
            self._give_back(taken)  # a slab could not be made (SlabUnavailable): all or none
            raise
        regions = []
        for (space, offset, size), requested in zip(taken, sizes, strict=True):
            region_id = next(self._region_ids)
            self._leases[region_id] = (space, offset, size)
            self._leased_bytes += size
            regions.append(Region(region_id, space.slab, offset, requested))
        self._most_leased = max(self._most_leased, self._leased_bytes)
        return regions

    @staticmethod
    def _give_back(taken: Sequence[tuple[_SlabSpace, int, int]]) -> None:
        for space, offset, size in taken:
            space.give_back(offset, size)

    def _place(self, size: int) -> tuple[_SlabSpace, int] | None:
        # Best fit over every slab: a small output (labels) takes the smallest free block that
        # holds it, not the start of an empty slab that the next batch's images need whole, so
        # a pool sized for a few batches holds them without growing (Note [A job's window] in
        # run_planner.py).
        best: tuple[int, _SlabSpace, int] | None = None
        for space in self._spaces:
            index = space.fit(size)
            if index is not None and (best is None or space.free[index][1] < best[0]):
                best = (space.free[index][1], space, index)
        if best is not None:
            _, space, index = best
            offset = space.take(size, index)
            assert offset is not None
            return space, offset
        slab_size = self._make_room(_align(size, PAGE))
        if slab_size is None:
            return None
        space = _SlabSpace(self._backend.create(self._next_slab_name(), slab_size))
        self._spaces.append(space)
        self.peak_slab_bytes = max(self.peak_slab_bytes, self.slab_bytes_total)
        offset = space.take(size)
        assert offset == 0
        return space, offset

    def _make_room(self, needed: int) -> int | None:
        """The size of a new slab holding ``needed`` bytes, freeing empty slabs if need be.

        Slabs are ``slab_bytes`` (or ``needed`` if larger); near the limit, a smaller one. A
        growing pool sizes a slab for as many whole regions of ``needed`` as ``slab_bytes``
        holds, at most ``GROWTH_REGIONS`` and at least one, and raises its limit to make it, or
        just ``needed``, if its growth allows. None when there is no room until regions are
        released.
        """
        preferred = max(self.slab_bytes, needed)
        if self._growth is not None:
            preferred = needed * max(1, min(GROWTH_REGIONS, self.slab_bytes // needed))
        room = self.limit_bytes - self.slab_bytes_total
        if room >= preferred:
            return preferred
        if self._growth is not None:
            for size in (preferred, needed):
                if size > room and self._growth.grow(size - room):
                    self.limit_bytes += size - room
                    return size
        empty = [space for space in self._spaces if space.empty]
        if room + sum(space.slab.size for space in empty) < needed:
            return None
        # Free the smallest empty slabs first: large ones are the costliest to recreate.
        for space in sorted(empty, key=lambda s: s.slab.size):
            if room >= needed:
                break
            self._retire(space)
            room += space.slab.size
        return max(needed, min(preferred, room // PAGE * PAGE))

    def _next_slab_name(self) -> str:
        self._next_slab_number += 1
        return f"{self._name_prefix}-{self._next_slab_number}"
