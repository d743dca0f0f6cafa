"""A cohort's figures for ``dalid status`` and its members' standing: runs, hits, copies, the
batches served to each member, and the members behind the window (docs/design/cohort-outputs.md,
"Past the window"). Not locked: its cohort calls it under the cohort's lock."""

from __future__ import annotations

import logging

from dalid.protocol import CohortStatus

log = logging.getLogger("dalid.server")


class CohortFigures:
    """What a cohort counts, and which of its members are behind."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.runs = 0
        self.hits = 0
        self.copied = 0
        self.served: dict[int, int] = {}  # batches served to each member
        self.behind: set[int] = set()  # members past the window now
        self.behind_runs = 0  # batches run for members behind

    def join(self, job_id: int) -> None:
        self.served.setdefault(job_id, 0)

    def leave(self, job_id: int) -> None:
        self.served.pop(job_id, None)
        self.behind.discard(job_id)

    def served_one(self, job_id: int) -> None:
        self.served[job_id] = self.served.get(job_id, 0) + 1

    def rank(self, job_id: int, behind: bool) -> bool:
        """``job_id`` is behind the window now, or not: whether that changed."""
        if behind == (job_id in self.behind):
            return False
        if behind:
            self.behind.add(job_id)
            log.info(
                "cohort %r: job %d trails past the window; its runs rank behind", self.name, job_id
            )
        else:
            self.behind.discard(job_id)
            log.info("cohort %r: job %d is back within the window", self.name, job_id)
        return True

    def status(
        self,
        jobs: tuple[int, ...],
        *,
        held_bytes: int,
        leased_bytes: int,
        window_bytes: int,
        dropped: int,
        device_bytes: int,
    ) -> CohortStatus:
        counts = list(self.served.values())
        runs, hits = self.runs, self.hits
        return CohortStatus(
            name=self.name,
            jobs=jobs,
            runs=runs,
            hits=hits,
            hit_rate=hits / (runs + hits) if runs + hits else 0.0,
            lag_batches=max(counts) - min(counts) if counts else 0,
            held_bytes=held_bytes,
            window_bytes=window_bytes,
            leased_bytes=leased_bytes,
            dropped=dropped,
            copied=self.copied,
            device_bytes=device_bytes,
            behind=tuple(sorted(self.behind)),
            behind_runs=self.behind_runs,
        )
