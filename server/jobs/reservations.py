"""Output memory reserved by jobs, against the daemon's ``--memory-limit``.

A job that asks for an amount (``memory_bytes`` in its hello) reserves it at connect, and is
refused there if the daemon has not that much left. A job that asks for none reserves nothing
at connect: its output pool grows as its pipelines' outputs need room, a slab at a time (sized
from the outputs), up to ``--pool-bytes``, while the daemon's limit allows. So a job counts
for what its pipelines' outputs take, which the daemon learns once they run, and an idle job
counts for nothing. A pool that cannot grow waits for its trainer to release outputs (as a full
pool always did); one that holds nothing yet fails its batch with the refusal below, which says
what the daemon has left and what to do.

Reservations only grow while the job lives (a pool keeps the room it once needed, to use again)
and are given back whole when it ends.
"""

from __future__ import annotations

import threading

from ..samples.paths import size_text
from .quotas import QuotaRefused


class OutputMemory:
    """What the jobs have reserved of ``limit`` bytes (0: no limit); thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._reservations: set[Reservation] = set()

    @property
    def reserved(self) -> int:
        with self._lock:
            return sum(reservation.bytes for reservation in self._reservations)

    def fixed(self, nbytes: int) -> Reservation:
        """``nbytes`` reserved at once for a job that asked for them (raises QuotaRefused)."""
        reservation = Reservation(self, cap=nbytes)
        if not reservation.grow(nbytes):
            raise QuotaRefused(reservation.refusal(nbytes, asked=True))
        return reservation

    def growing(self, cap: int) -> Reservation:
        """Nothing reserved yet; the job's pool grows it up to ``cap``."""
        return Reservation(self, cap=cap)

    def _try_add(self, reservation: Reservation, nbytes: int) -> bool:
        with self._lock:
            if reservation.closed or reservation.bytes + nbytes > reservation.cap:
                return False
            reserved = sum(r.bytes for r in self._reservations)
            if self.limit and reserved + nbytes > self.limit:
                return False
            reservation.bytes += nbytes
            self._reservations.add(reservation)
            return True

    def _available(self, reservation: Reservation) -> int:
        with self._lock:
            if reservation.closed:
                return 0
            left = reservation.cap - reservation.bytes
            if self.limit:
                reserved = sum(r.bytes for r in self._reservations)
                left = min(left, self.limit - reserved)
            return max(left, 0)

    def _close(self, reservation: Reservation) -> None:
        with self._lock:
            reservation.closed = True
            self._reservations.discard(reservation)

    def _summary(self) -> tuple[int, int]:
        """Bytes reserved, and by how many reservations (jobs: one each)."""
        with self._lock:
            held = [r.bytes for r in self._reservations if r.bytes]
            return sum(held), len(held)


class Reservation:
    """One pool's reserved bytes (``bytes``), at most ``cap``; see the module's docstring."""

    def __init__(self, memory: OutputMemory, cap: int) -> None:
        self._memory = memory
        self.cap = cap
        self.bytes = 0
        self.closed = False

    def grow(self, nbytes: int) -> bool:
        """Reserves ``nbytes`` more; whether the cap and the daemon's limit allow it."""
        return self._memory._try_add(self, nbytes)

    def available(self) -> int:
        """How much more it could reserve now (the cap and the daemon's limit allowing)."""
        return self._memory._available(self)

    def refusal(self, nbytes: int, asked: bool = False) -> str:
        """Why ``nbytes`` more could not be reserved, and what to do."""
        reserved, jobs = self._memory._summary()
        limit = self._memory.limit
        left = max(limit - reserved, 0)
        what = "asks for" if asked else "needs"
        if limit and (asked or self.bytes + nbytes <= self.cap):
            return (
                f"the job {what} {size_text(nbytes)} of output memory and this daemon has "
                f"{size_text(left)} left of its --memory-limit {size_text(limit)} ({jobs} jobs "
                f"hold {size_text(reserved)}): ask for less (memory_bytes=), wait for other jobs "
                "to end, or start the daemon with a higher --memory-limit"
            )
        return (
            f"the job {what} {size_text(self.bytes + nbytes)} of output memory, more than its "
            f"limit of {size_text(self.cap)}: ask for more (memory_bytes=), start the daemon "
            "with a higher --pool-bytes, or use a smaller batch"
        )

    def close(self) -> None:
        """Gives the reservation back. Idempotent."""
        self._memory._close(self)
