"""Idle jobs reclaimed: which job a newcomer's hello ends when a limit of jobs is full.

A job that holds a place and does nothing keeps every later job of its kind out: within one uid
(every trainer of a cluster often runs as one user), a few processes holding idle jobs fill the
uid's share. When a hello is refused because a limit of jobs is full (``--max-jobs``, or the
newcomer's uid's share; never the per-process limit: a process may not end others' jobs to pass
its own), the daemon ends the job idle longest among those the newcomer competes with, provided
it has been idle for at least ``--reclaim-idle-s``, and welcomes the newcomer:

- for the uid's share, the jobs of the newcomer's uid (which frees a place of the daemon too);
- for the daemon's limit, the jobs of the uid that holds the most (of each uid that holds as
  many, where several do).

A job is idle while it has no batch in flight, waiting or deferred, and none was submitted,
scheduled, wanted, released or delivered, nor a pipeline registered, since ``active_at``
(its connect at first); pings do not count. Its trainer and workers are told why (an
``error`` ``unknown_job`` with ``ends_jobs``, SPEC.md "Liveness"; endings.py). A job ended
so that reconnects is a new job with a fresh clock: it ends another only once that one has
been idle as long, so two jobs idling in turn take the place in turn, never faster than one
end per idle period.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Protocol, TypeVar

from .quotas import JobsFull


class IdleCandidate(Protocol):
    """What the choice reads of a job."""

    @property
    def uid(self) -> int: ...

    @property
    def active_at(self) -> float: ...

    @property
    def busy(self) -> bool: ...


J = TypeVar("J", bound=IdleCandidate)


def job_to_end(
    jobs: Iterable[J], full: JobsFull, *, uid: int, now: float, idle_s: float
) -> J | None:
    """The job to end so that a newcomer of ``uid`` finds room under the ``full`` limit: the
    one idle longest among those it competes with, if idle for ``idle_s`` at least by ``now``
    (monotonic); None if none is, or if reclaiming is off (``idle_s`` 0)."""
    if idle_s <= 0:
        return None
    jobs = list(jobs)
    if full is JobsFull.USER:
        rivals = [job for job in jobs if job.uid == uid]
    else:
        held = Counter(job.uid for job in jobs)
        most = max(held.values(), default=0)
        rivals = [job for job in jobs if held[job.uid] == most]
    idle = [job for job in rivals if not job.busy and now - job.active_at >= idle_s]
    return min(idle, key=lambda job: job.active_at, default=None)
