"""A job's delivered batches still leased, by region id: what to call once one is all back."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence


class _LeasedBatch:
    """A delivered batch's regions still leased, and what to call when none is."""

    __slots__ = ("released", "remaining")

    def __init__(self, remaining: int, released: Callable[[], None]) -> None:
        self.remaining = remaining
        self.released = released


class DeliveredBatches:
    """Calls each delivered batch's ``released`` once the trainer has released every region of
    it. Thread-safe: executors register batches from their threads while the I/O thread
    releases; the callbacks run outside the lock."""

    def __init__(self) -> None:
        self._batches: dict[int, _LeasedBatch] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._batches)

    def add(self, region_ids: Sequence[int], released: Callable[[], None]) -> None:
        """Calls ``released`` once every one of ``region_ids`` is released (a delivered
        batch's; registered before its ``batch_ready`` goes)."""
        batch = _LeasedBatch(len(region_ids), released)
        with self._lock:
            for region_id in region_ids:
                self._batches[region_id] = batch

    def released(self, region_ids: Sequence[int]) -> None:
        """The trainer released ``region_ids``: calls ``released`` of each batch now all back.
        Ids of no batch registered here are ignored."""
        done = []
        with self._lock:
            for region_id in region_ids:
                batch = self._batches.pop(region_id, None)
                if batch is not None:
                    batch.remaining -= 1
                    if not batch.remaining:
                        done.append(batch.released)
        for released in done:
            released()

    def clear(self) -> None:
        """The job ended: no batch's ``released`` is called any more."""
        with self._lock:
            self._batches.clear()
