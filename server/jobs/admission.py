"""A job's batches in flight: at most its limit run or queue, the rest wait for their turn.

A submitted batch is *accepted* (``batch_accepted``) when it goes to its pipeline. A job may have
``max_inflight_batches`` accepted and not yet answered; a batch over that waits here, its
acceptance held back, until an earlier batch of the job is answered (backpressure: a worker
sends its next batch only once its last one was accepted, so one that runs ahead of its
trainer is slowed down, not refused). At most
``max_waiting_batches`` wait, each holding its samples in the daemon's memory; more are refused.
The batch the trainer waits for passes the limit by one (``Admission.want``).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dalid.protocol import ErrorCode

from ..errors import RequestRefused

if TYPE_CHECKING:
    from ..runs.runs import Executor, PendingBatch


@dataclass
class WaitingBatch:
    """A batch received over its job's in-flight limit: its sender waits for the acceptance."""

    sender: bytes
    request_id: int | None
    batch: PendingBatch
    executor: Executor


class Admission:
    """The in-flight count and the waiting batches of one job. Thread-safe: the I/O thread
    submits, executor threads report answered batches."""

    def __init__(self, job_id: int, max_inflight: int, max_waiting: int) -> None:
        self._job_id = job_id
        self.max_inflight = max_inflight
        self._max_waiting = max_waiting
        self._lock = threading.Lock()
        self._inflight = 0
        self._waiting: collections.deque[WaitingBatch] = collections.deque()
        self._closed = False

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        """Whether any batch of the job is in flight or waits for its turn."""
        with self._lock:
            return self._inflight > 0 or bool(self._waiting)

    def submit(
        self,
        batch: PendingBatch,
        executor: Executor,
        sender: bytes,
        request_id: int | None,
    ) -> bool:
        """Hands ``batch`` to ``executor`` if the job is under its limit (True: answer with the
        acceptance now), or keeps it waiting (False: it is answered once admitted). Raises
        RequestRefused when too many wait already."""
        with self._lock:
            if self._inflight < self.max_inflight:
                self._inflight += 1
                batch.counted = True
                executor.submit(batch)
                return True
            if len(self._waiting) >= self._max_waiting:
                raise RequestRefused(
                    ErrorCode.RESOURCE_EXHAUSTED,
                    f"job {self._job_id} already has {len(self._waiting)} batches waiting over "
                    f"its limit of {self.max_inflight} in flight: wait for batch acceptances "
                    "before sending more",
                )
            self._waiting.append(WaitingBatch(sender, request_id, batch, executor))
            return False

    def answered(self, batch: PendingBatch) -> WaitingBatch | None:
        """``batch`` was answered: the batch admitted in its place, already handed to its
        executor, whose sender is to be told; None if none."""
        if not batch.counted:
            return None
        with self._lock:
            self._inflight -= 1
            admitted = None
            # Under the limit again: a wanted batch may have passed it by one (``want``).
            if self._waiting and not self._closed and self._inflight < self.max_inflight:
                admitted = self._waiting.popleft()
                self._inflight += 1
                admitted.batch.counted = True
        if admitted is not None:
            admitted.executor.submit(admitted.batch)
        return admitted

    def want(self, batch_id: int) -> WaitingBatch | None:
        """The trainer waits for ``batch_id``: if it waits here, it is admitted now, past the
        limit by one, and returned (handed to its executor; its sender is to be told).

        The batches in flight may be ones the trainer takes later, delivered early and held
        in the job's window, or queued behind it (Note [A job's window] in job_window.py):
        none of them is answered until the trainer releases a batch, which it does only once
        it has the one it waits for. Admitted in arrival order, that one would wait for ever.
        """
        with self._lock:
            if self._closed or self._inflight > self.max_inflight:
                return None  # closing, or another wanted batch is over the limit already
            wanted = next((w for w in self._waiting if w.batch.batch_id == batch_id), None)
            if wanted is None:
                return None
            self._waiting.remove(wanted)
            self._inflight += 1
            wanted.batch.counted = True
        wanted.executor.submit(wanted.batch)
        return wanted

    def drop_sender(self, sender: bytes) -> list[WaitingBatch]:
        """Drops the waiting batches of a connection that closed; returns them."""
        with self._lock:
            kept = [waiting for waiting in self._waiting if waiting.sender != sender]
            dropped = [waiting for waiting in self._waiting if waiting.sender == sender]
            self._waiting = collections.deque(kept)
        return dropped

    def close(self) -> list[WaitingBatch]:
        """Admits nothing more; the batches that still waited, whose senders are to be told."""
        with self._lock:
            self._closed = True
            waiting = list(self._waiting)
            self._waiting.clear()
        return waiting
