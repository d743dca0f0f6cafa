"""The daemon's cohorts by name (``cohorts.py``): who may join one, and the end of one whose last
member has left."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Hashable, Sequence

from dalid.protocol import CohortStatus, ErrorCode, Limits

from ..errors import RequestRefused
from ..outputs.job_outputs import JobOutputs
from .cohorts import Alive, Charge, Cohort, Rank, no_charge, no_rank
from .runs import Member

log = logging.getLogger("dalid.server")

MakeOutputs = Callable[[str, Limits], JobOutputs]


class Cohorts:
    """The daemon's cohorts by name. ``make_outputs(prefix, limits)`` makes a cohort's CPU
    output memory; ``memory_bytes``: the most output memory of one cohort (0: the pool bytes of
    the job that starts it), of which half may wait for trailing members; ``charge``
    and ``share`` count a share of a cohort's run to a job (the scheduler's), ``behind`` ranks
    a member past the window (docs/design/cohort-outputs.md)."""

    def __init__(
        self,
        make_outputs: MakeOutputs,
        memory_bytes: int,
        alive: Alive,
        *,
        charge: Charge = no_charge,
        share: Charge = no_charge,
        behind: Rank = no_rank,
    ) -> None:
        self._make_outputs = make_outputs
        self.memory_bytes = memory_bytes
        self._alive = alive
        self._charge = charge
        self._share = share
        self._behind = behind
        self._cohorts: dict[str, Cohort] = {}
        # Ended cohorts whose GPU slabs members' processes may still map (cohorts.py).
        self._closing: list[Cohort] = []
        self._numbers = itertools.count(1)

    def check(self, name: str, key: Hashable, deterministic: bool, job_id: int = 0) -> None:
        """Refuses a registration of job ``job_id`` that cannot join cohort ``name`` (as data:
        RequestRefused)."""
        if deterministic:
            raise RequestRefused(
                ErrorCode.INVALID_PIPELINE,
                f"cohort {name!r}: a deterministic pipeline cannot join a cohort (its trainer "
                "orders its batches; a cohort's members share the runs of whoever submits first)",
            )
        if key is None:
            raise RequestRefused(
                ErrorCode.INVALID_PIPELINE,
                f"cohort {name!r}: the pipeline cannot be compared with other jobs' (its graph "
                "could not be read), so it cannot join a cohort",
            )
        cohort = self._cohorts.get(name)
        if cohort is not None and job_id in cohort.members:
            raise RequestRefused(
                ErrorCode.INVALID_PIPELINE,
                f"cohort {name!r}: job {job_id} is a member already (a job joins a cohort with "
                "one pipeline)",
            )
        if cohort is not None and cohort.key != key:
            raise RequestRefused(
                ErrorCode.INVALID_PIPELINE,
                f"cohort {name!r} runs another pipeline: {_difference(cohort.key, key)}; every "
                "member of a cohort registers the same graph with the same inputs, outputs and "
                "batch size",
            )

    def join(self, name: str, key: Hashable, member: Member, limits: Limits, prefix: str) -> Cohort:
        cohort = self._cohorts.get(name)
        if cohort is None:
            memory = self.memory_bytes or limits.pool_bytes
            outputs = self._make_outputs(
                f"{prefix}-c{next(self._numbers)}",
                dataclasses.replace(limits, pool_bytes=memory),
            )
            cohort = Cohort(
                name,
                key,
                outputs,
                memory // 2,
                self._alive,
                charge=self._charge,
                share=self._share,
                behind=self._behind,
            )
            self._cohorts[name] = cohort
            log.info("cohort %r started, %d MiB of output memory", name, memory >> 20)
        cohort.join(member)
        log.info("job %d joined cohort %r (%d members)", member.job_id, name, len(cohort.members))
        return cohort

    def leave(self, member: Member, pid: int, namespace: int) -> None:
        joined = member.cohort
        if joined is None:
            return
        joined.leave(member, pid, namespace)
        cohort = self._cohorts.get(joined.name)
        if cohort is joined and cohort.empty:
            del self._cohorts[cohort.name]
            if cohort.close():
                self._closing.append(cohort)
            log.info("cohort %r ended with its last member", cohort.name)

    def peer_leaving(self, job_id: int, kept_slabs: Sequence[str]) -> None:
        """Job ``job_id``'s trainer said goodbye, still mapping ``kept_slabs`` only."""
        for cohort in list(self._cohorts.values()):
            if job_id in cohort.members:
                cohort.peer_leaving(job_id, kept_slabs)

    def reap(self) -> None:
        for cohort in list(self._cohorts.values()):
            cohort.reap()
        for cohort in list(self._closing):
            cohort.reap()
            if not cohort.awaiting_peers:
                self._closing.remove(cohort)
                cohort.free()

    def status(self) -> tuple[CohortStatus, ...]:
        return tuple(cohort.status() for cohort in list(self._cohorts.values()))

    def close(self) -> None:
        cohorts, self._cohorts = list(self._cohorts.values()), {}
        closing, self._closing = self._closing, []
        for cohort in [*cohorts, *closing]:
            cohort.close()
            cohort.free()


def _difference(theirs: Hashable, ours: Hashable) -> str:
    """What differs between two cohort keys, in words."""
    names: tuple[str, ...] = ("kind", "graph", "inputs", "outputs", "batch size")
    if isinstance(theirs, tuple) and theirs and theirs[0] == "named":
        names = ("kind", "pipeline name", "parameters", "batch size")
    if isinstance(theirs, tuple) and isinstance(ours, tuple) and len(theirs) == len(ours):
        differ = [
            names[i] if i < len(names) else f"field {i}"
            for i, (a, b) in enumerate(zip(theirs, ours, strict=True))
            if a != b
        ]
        if differ:
            return "its members' " + " and ".join(differ) + " differ from this registration's"
    return "its members' graph differs from this registration's"
