"""The batch inputs the daemon holds, bounded: all jobs together, and each job on its own.

A batch the daemon accepts keeps its samples (the frames it came in) until its result has gone:
queued for its pipeline, inside DALI, held back over its job's in-flight limit, or deferred
until the trainer schedules it. :class:`InputMemory` counts those bytes. A batch that would take
the daemon past ``limit``, or its job past half of it (so that one job cannot take what the
others need), is refused at once and its frames freed; the refusal says what the daemon holds
and what to do. A job that waits for its batches' acceptances, as dalid's client does, holds its
in-flight batches and one more per connection, far below these limits.

What a batch holds is given back once its result has gone (the daemon then drops its samples,
even while the trainer keeps its outputs), or when the batch is freed, whatever path it took
(dropped with its job or its worker): whichever comes first, once.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from collections.abc import Callable

from ..samples.paths import size_text


class InputRefused(Exception):
    """A batch over the daemon's or its job's share of input memory; the message says which."""


class InputMemory:
    """Bytes of batch inputs held, per job and in all; thread-safe (batches are freed in
    executor threads)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._by_job: defaultdict[int, int] = defaultdict(int)
        self._total = 0
        self._peak = 0

    @property
    def job_limit(self) -> int:
        """What one job may hold: half the daemon's limit."""
        return self.limit // 2

    @property
    def held(self) -> int:
        return self._total

    def take_peak(self) -> int:
        """The most held at once since the last call, and starts the next span.

        Batches may come and go between two looks at :attr:`held`; this sees them.
        """
        with self._lock:
            peak, self._peak = self._peak, self._total
            return peak

    def held_by(self, job_id: int) -> int:
        with self._lock:
            return self._by_job.get(job_id, 0)

    def take(self, job_id: int, nbytes: int, holder: object) -> Callable[[], object]:
        """Counts ``nbytes`` for ``job_id`` until ``holder`` (the batch) is freed or the
        returned function is called, whichever comes first; raises :class:`InputRefused`
        instead when that would overstep a limit."""
        with self._lock:
            held = self._by_job.get(job_id, 0)
            if held + nbytes > self.job_limit:
                raise InputRefused(
                    f"job {job_id} holds {size_text(held)} of batch inputs in the daemon, and "
                    f"this batch of {size_text(nbytes)} would take it over its share, half the "
                    f"daemon's --input-memory {size_text(self.limit)}: wait for batch results "
                    "before sending more, send smaller batches, or start the daemon with a "
                    "higher --input-memory"
                )
            if self._total + nbytes > self.limit:
                raise InputRefused(
                    f"the daemon holds {size_text(self._total)} of batch inputs for its jobs, "
                    f"and this batch of {size_text(nbytes)} would take it over its --input-memory "
                    f"{size_text(self.limit)}: wait for batch results before sending more, or "
                    "start the daemon with a higher --input-memory"
                )
            self._by_job[job_id] = held + nbytes
            self._total += nbytes
            self._peak = max(self._peak, self._total)
        # A finalizer runs once: called early, it does nothing when the holder is freed.
        return weakref.finalize(holder, self._give_back, job_id, nbytes)

    def _give_back(self, job_id: int, nbytes: int) -> None:
        with self._lock:
            left = self._by_job[job_id] - nbytes
            if left:
                self._by_job[job_id] = left
            else:
                del self._by_job[job_id]
            self._total -= nbytes
