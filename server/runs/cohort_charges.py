"""The charge of one shared run, split among the members of its cohort that consumed it
(docs/design/cohort-outputs.md, "Charging"): its producer pays when the run ends, and each
member given its outputs later takes an equal share, taken back from the others, so the parts
always add up to the run's service time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

# charge(job_id, seconds): counts seconds of a run to a job's ``run_seconds``; share(job_id,
# seconds) also moves its fair-share tag (FairScheduler.share_run); negative, takes back.
Charge = Callable[[int, float], None]


def no_charge(job_id: int, seconds: float) -> None:
    pass


class Charged(NamedTuple):
    """Seconds counted to a job; ``moves_tag``: its fair-share tag moves with them."""

    job_id: int
    seconds: float
    moves_tag: bool


@dataclass
class RunCharge:
    """The service time of one run and the jobs it has been charged to so far, in order."""

    seconds: float = 0.0
    payers: list[int] = field(default_factory=list)

    def produced(self, job_id: int, seconds: float) -> list[Charged]:
        """The run's producer ``job_id`` pays ``seconds`` of it, alone so far; its slot paid
        the run's tag, so its tag does not move."""
        self.seconds += seconds
        self.payers = [job_id]
        return [Charged(job_id, seconds, False)]

    def share(self, job_id: int) -> list[Charged]:
        """``job_id`` consumed the run too: its share, and the others' taken back; nothing
        for a run not charged yet or a job that pays a share already."""
        if not self.seconds or job_id in self.payers:
            return []
        before = len(self.payers)
        after = before + 1
        charged = [
            Charged(payer, self.seconds / after - self.seconds / before, True)
            for payer in self.payers
        ]
        charged.append(Charged(job_id, self.seconds / after, True))
        self.payers.append(job_id)
        return charged
