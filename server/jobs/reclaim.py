"""Idle jobs reclaimed: which job a newcomer ends when a limit it competes for is full.

A job that holds a place and does nothing keeps every later job of its kind out: within one uid
(every trainer of a cluster often runs as one user), a few processes holding idle jobs fill the
uid's share, and a few jobs holding idle pipelines fill the daemon's pipelines or DALI threads.
When a hello is refused because a limit of jobs is full (``--max-jobs``, or the newcomer's
uid's share), or a new pipeline because a limit of pipelines or DALI threads is
(``--max-daemon-pipelines``, ``--max-threads``, or the uid's part of them; never a per-process
or per-job limit: a process or job may not end others to pass its own), the daemon ends the
job idle longest among those the newcomer competes with, provided it has been idle for at
least ``--reclaim-idle-s``, and welcomes the newcomer or starts its pipeline:

- for the uid's share, the jobs of the newcomer's uid (which frees a place of the daemon too);
- for the daemon's limit, the jobs of the uid that holds the most (of each uid that holds as
  many, where several do).

What a job holds of a limit is what its end frees: a place of the jobs; the pipelines it alone
runs (a pipeline it shares with another job goes on) and their DALI threads. A job that holds
none of the full limit is never ended for it, nor is the job that asks.

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
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from .quotas import Full


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
    jobs: Iterable[J],
    full: Full,
    *,
    uid: int,
    now: float,
    idle_s: float,
    holds: Callable[[J], int] | None = None,
    asking: object = None,
) -> J | None:
    """The job to end so that a newcomer of ``uid`` finds room under the ``full`` limit: the
    one idle longest among those it competes with, if idle for ``idle_s`` at least by ``now``
    (monotonic); None if none is, or if reclaiming is off (``idle_s`` 0).

    ``holds(job)``: how much of the full limit the job's end frees (None: a place of the jobs,
    for a hello; its pipelines or DALI threads for a pipeline): a job holding none is
    not ended, and a uid holds the sum of its jobs'. ``asking``: the newcomer's own job, where
    it has one (its holdings count for its uid), which is never ended for itself."""
    if idle_s <= 0:
        return None
    held = [(job, 1 if holds is None else holds(job)) for job in jobs]
    held = [(job, amount) for job, amount in held if amount > 0]
    if full is Full.USER:
        rivals = [job for job, _ in held if job.uid == uid]
    else:
        of_uid: Counter[int] = Counter()
        for job, amount in held:
            of_uid[job.uid] += amount
        most = max(of_uid.values(), default=0)
        rivals = [job for job, _ in held if of_uid[job.uid] == most]
    idle = [
        job
        for job in rivals
        if job is not asking and not job.busy and now - job.active_at >= idle_s
    ]
    return min(idle, key=lambda job: job.active_at, default=None)
