"""Ending an idle job to make room for a newcomer: a new job's hello (opening.py) or another
job's new pipeline (batch_requests.py) that a full limit refuses.

:class:`IdleReclaim` asks reclaim.py which job to end, ends it through the daemon's endings with
the reason its trainer is told, and words the refusal where none has been idle long enough.
What a job holds of a limit on pipelines is what its end frees: the pipelines it alone runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..jobs.jobs import Job, JobRegistry, job_label
from ..jobs.quotas import Full
from ..jobs.reclaim import job_to_end
from .budget import Holding, PipelineBudget

log = logging.getLogger("dalid.server")


class IdleReclaim:
    """Ends the idle job of ``registry`` that a newcomer competes with, once idle ``idle_s``
    (0: never), through ``end_job(job, why)`` (endings.py; None: no job is ever ended)."""

    def __init__(
        self,
        registry: JobRegistry,
        idle_s: float,
        end_job: Callable[[Job, str], None] | None,
    ) -> None:
        self._registry = registry
        self.idle_s = idle_s if end_job is not None else 0.0
        self._end_job = end_job

    def end_for(
        self,
        full: Full,
        what: str,
        *,
        uid: int,
        newcomer: str,
        holds: Callable[[Job], int] | None = None,
        asking: Job | None = None,
    ) -> bool:
        """Ends the job idle longest that ``newcomer`` (in words) of ``uid`` competes with under
        the ``full`` limit (``what``, in words), if one has been idle long enough; whether one
        was. ``holds`` and ``asking``: as reclaim.py's ``job_to_end`` takes them."""
        if self._end_job is None:
            return False
        now = time.monotonic()
        jobs = self._registry.jobs.values()
        job = job_to_end(
            jobs, full, uid=uid, now=now, idle_s=self.idle_s, holds=holds, asking=asking
        )
        if job is None:
            return False
        idle = now - job.active_at
        log.info(
            "job %d (%s) reclaimed after %.0f s idle, for %s: %s",
            job.job_id,
            job_label(job.name, job.pid),
            idle,
            newcomer,
            what,
        )
        self._end_job(
            job,
            f"job {job.job_id} was ended after {idle:.0f} s idle, to make room for {newcomer}; "
            f"the daemon is full: {what}. Connect again when the job has batches to run "
            "(a session with reconnect=True does so at its next call, and is refused while the "
            "daemon stays full), or start the daemon with a longer --reclaim-idle-s (now "
            f"{self.idle_s:g} s; 0: never end idle jobs)",
        )
        return True

    def refused(self, message: str) -> str:
        """The message of a refusal that ending an idle job could have spared: it says that
        none of the jobs it competes with has been idle long enough."""
        if self.idle_s <= 0:
            return message
        return (
            f"{message}; none of the jobs it competes with has been idle for {self.idle_s:g} s, "
            "which the daemon would end to make room (dalid serve --reclaim-idle-s)"
        )


def pipelines_held(budget: PipelineBudget, holding: Holding, full: Full) -> Callable[[Job], int]:
    """What a job holds of the daemon's pipelines or threads (``holding``), or of its uid's
    share of them (``full``), as its end would free them: those of the pipelines it alone runs;
    one it shares with another job goes on."""

    def holds(job: Job) -> int:
        alone = {
            member.executor.instance_id
            for member in job.pipelines.values()
            if member.executor is not None
            and all(other.job_id == job.job_id for other in list(member.executor.members))
        }
        return budget.held(alone, holding, job.uid if full is Full.USER else None)

    return holds
