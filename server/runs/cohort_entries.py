"""A cohort's entries: a batch's inputs, the one run that serves them to every member that
submits them, and its outputs once run (docs/design/cohort-outputs.md); what a member's batch
becomes when it is matched."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dalid.protocol import BatchReady, InputBatch, OutputDescriptor

from ..outputs.run_output import RunOutput
from .cohort_charges import RunCharge
from .runs import Outcome, PendingBatch

__all__ = ["Entry", "EntryRuns", "EntryState", "Outcome", "Settle"]

Settle = Callable[[], None]


class EntryRuns(Protocol):
    """Who settles the runs of its entries (``cohorts.Cohort``), as an entry calls it."""

    def write(
        self,
        outputs: Sequence[RunOutput],
        rows: range,
        source_stream: int | None,
        entry: Entry | None = None,
    ) -> tuple[OutputDescriptor, ...] | None: ...

    def account(self, entry: Entry, seconds: float) -> None: ...

    def publish(
        self, entry: Entry, descriptors: tuple[OutputDescriptor, ...], settle: Settle
    ) -> list[tuple[PendingBatch, BatchReady | None]]: ...

    def take_recipients(self, entry: Entry) -> list[PendingBatch]: ...

    def abandon(self, entry: Entry) -> list[PendingBatch]: ...


class EntryState(enum.Enum):
    """Where an entry's run is: queued or running, its outputs in the cohort's memory, or
    gone (its run failed or went elsewhere, or its regions went back to the pool)."""

    PENDING = "pending"
    READY = "ready"
    GONE = "gone"


@dataclass(eq=False)
class Entry:
    """A batch's inputs, the run that serves them to every member, and its outputs once run.

    Its fields are its parts' to change: ``state``, ``cached``, ``nbytes`` the cache's
    (``cohort_cache.py``), ``leases`` the leases' (``cohort_leases.py``), ``parked`` the
    members' windows' (``cohort_windows.py``), ``charge`` the charges' (``cohort_charges.py``);
    the rest the cohort's, under its lock."""

    cohort: EntryRuns
    digest: bytes
    inputs: tuple[InputBatch, ...]
    unreadable: tuple[int, ...]
    producer: PendingBatch | None
    followers: list[PendingBatch] = field(default_factory=list)
    state: EntryState = EntryState.PENDING
    served: set[int] = field(default_factory=set)  # the jobs given it, or waiting for it
    descriptors: tuple[OutputDescriptor, ...] = ()
    # The run's batch event, where it wrote GPU outputs: every member's stream waits on it.
    event: str = ""
    nbytes: int = 0
    # Leases of its regions, and pins of it while a private copy is read from it.
    leases: int = 0
    cached: bool = False
    # Batches of members whose window was full, waiting for room.
    parked: int = 0
    charge: RunCharge = field(default_factory=RunCharge)

    def payers(self) -> list[int]:
        """The jobs waiting for its run: its producer's and its followers'."""
        batches = [self.producer, *self.followers]
        return [b.member.job_id for b in batches if b is not None and b.member is not None]

    def recipients(self) -> list[PendingBatch]:
        """Its producer's batch and its followers', in that order."""
        return [b for b in (self.producer, *self.followers) if b is not None]

    @property
    def on_gpu(self) -> bool:
        """Whether its outputs are in the cohort's GPU memory."""
        return any(d.device == "cuda" for d in self.descriptors)

    # Its run, as the executor that runs it sees it (runs.CohortRun): the cohort's to settle.

    def write(
        self, outputs: Sequence[RunOutput], rows: range, source_stream: int | None
    ) -> tuple[OutputDescriptor, ...] | None:
        return self.cohort.write(outputs, rows, source_stream, self)

    def account(self, seconds: float) -> None:
        self.cohort.account(self, seconds)

    def publish(
        self, descriptors: tuple[OutputDescriptor, ...], settle: Settle
    ) -> list[tuple[PendingBatch, BatchReady | None]]:
        return self.cohort.publish(self, descriptors, settle)

    def take_recipients(self) -> list[PendingBatch]:
        return self.cohort.take_recipients(self)

    def abandon(self) -> list[PendingBatch]:
        return self.cohort.abandon(self)
