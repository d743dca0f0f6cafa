"""The batches a pipeline runs: which job's registration each belongs to, and the runs they
form.

A pipeline in the daemon serves one or more *members*: the registrations of jobs that run it.
A pipeline of its own has one; a shared pipeline (``sharing.py``) has one per job that
registered the same graph. Each submitted batch waits in its member's queue until the
pipeline's executor puts it into a *run*: one call of the DALI pipeline on the samples of one
or more batches, up to the pipeline's run size. After the run, each batch's rows of the outputs
go to its own job's output memory, so quotas, releases, bad samples and a job's death stay the
job's own. Which batches form a pipeline's next run is :mod:`dalid.server.runs.run_planner`'s
to say.
"""

from __future__ import annotations

import collections
import enum
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dalid.protocol import BatchFailed, BatchReady, OnError, OutputDescriptor, SubmitBatch

from ..outputs.job_outputs import JobOutputs
from ..outputs.run_output import RunOutput
from ..samples.packed import PackedSamples

if TYPE_CHECKING:
    from ..pipelines.spec import PipelineSpec
    from .stopping import Stop

# After one of its batches had bad samples, a job's next batches of the pipeline run alone,
# not mixed with other jobs' samples, so that another bad one costs no other job a rerun.
QUARANTINE_BATCHES = 8

_arrivals = itertools.count()


@dataclass(eq=False)
class PendingBatch:
    batch_id: int
    request: SubmitBatch
    member: Member | None = None
    # Each input's samples, viewed in place in its frame: one array when they have one shape,
    # else a list (``InputBatch.arrays``), or for paths of several lengths, left packed
    # (``packed.py``).
    arrays: dict[str, np.ndarray | Sequence[np.ndarray]] = field(default_factory=dict)
    # Samples bad before they run, by position, with why (found once): images over the
    # daemon's pixel limit, files nobody can read.
    oversized: dict[int, str] | None = None
    # Why the batch cannot run at all, or "": a file the daemon cannot see, files or sizes
    # over its job's limits (paths.py, sizes.py).
    refused: str = ""
    # Whether the batch counts against its job's in-flight limit (deferred ones do not).
    counted: bool = False
    # It runs in a run of its own: it was in a mixed run that failed.
    runs_alone: bool = False
    # It counts in its job's window (taken into a run, its regions not yet all released).
    held: bool = False
    arrival: int = field(default_factory=lambda: next(_arrivals))
    # The cohort's entry this batch runs for (its outputs serve every member that submits the
    # same inputs: cohorts.py), or None.
    cohort_entry: CohortRun | None = None
    # Gives the samples' bytes back to the daemon's input memory (jobs/inputs.py), once.
    give_back_inputs: Callable[[], object] | None = None

    @property
    def size(self) -> int:
        return self.request.batch_size

    def drop_samples(self) -> None:
        """Its result has gone: the batch may stay in its job's window until the trainer
        releases its outputs, which a loop that keeps them never does, but without its
        samples, which go back to the daemon's input memory now."""
        self.request = self.request.without_samples()
        self.arrays = {}
        if self.give_back_inputs is not None:
            self.give_back_inputs()
            self.give_back_inputs = None

    def input_kinds(self) -> tuple[tuple[str, str, int], ...]:
        """What DALI needs alike in every batch of one run: each input's dtype and rank."""
        return tuple(sorted((item.name, item.dtype, item.ndim) for item in self.request.inputs))


class Outcome(enum.Enum):
    """What a submitted batch of a member becomes (``cohorts.Cohort.take``)."""

    RUN = "run"  # runs, as an entry other members may match
    FOLLOW = "follow"  # waits for another member's run of the same inputs
    HIT = "hit"  # served now, from the cache
    PARKED = "parked"  # served from the cache once its job's window has room
    ALONE = "alone"  # runs for its job alone, as a batch of no cohort


Answer = Callable[[PendingBatch, "BatchReady | BatchFailed"], None]
"""answer(batch, result): sends a batch's result on; called from the executor's thread."""


# How many workers that left a member remembers (their batches still running or queued when
# they left: a few epochs' worth of DataLoader workers).
SENDERS_REMEMBERED = 256


@dataclass(eq=False)
class Member:
    """One job's registration of a pipeline: where its batches' outputs and results go.

    ``pipeline_id`` is the job's id of the pipeline (what its batches and results name);
    ``writing`` is held while the executor writes outputs into the job's memory, so that a job
    that leaves knows no write is under way once it has taken it.
    """

    job_id: int
    pipeline_id: int
    outputs: JobOutputs
    answer: Answer
    on_error: OnError
    deterministic: bool = False
    executor: Executor | None = None
    queue: collections.deque[PendingBatch] = field(default_factory=collections.deque)
    closed: bool = False
    # Batches still to run alone (QUARANTINE_BATCHES after one had bad samples).
    quarantine: int = 0
    # Since when its batches wait for its job's memory (None: they do not).
    starved_since: float | None = None
    # Its window (Note [A job's window] in job_window.py, whose JobWindow changes these): its
    # batches in the window by id, taken into a run and not yet answered, or delivered and not
    # yet released; the id ranges of the job's workers that left (``batch_id //
    # BATCH_IDS_PER_CONNECTION``, oldest first), whose batches count no more; the batch its
    # trainer waits for, as its last ``want_batch`` named it; since when that batch waits for a
    # full window; and whether its batches pass the window until the trainer releases a batch.
    holding: dict[int, PendingBatch] = field(default_factory=dict)
    senders_left: dict[int, None] = field(default_factory=dict)
    wanted: int | None = None
    want_blocked_since: float | None = None
    overflow: bool = False
    writing: threading.Lock = field(default_factory=threading.Lock)
    # The cohort the job joined with this registration (cohorts.py), or None.
    cohort: JoinedCohort | None = None
    # The most bytes of files one batch of the job may have the daemon read (its share of the
    # daemon's input memory: paths.py), and of outputs its batches may certainly make (its
    # output memory: sizes.py); 0: no limit.
    read_bytes: int = 0
    output_bytes: int = 0

    @property
    def held(self) -> int:
        """How many batches its window holds."""
        return len(self.holding)

    @property
    def queued(self) -> int:
        return len(self.queue)

    @property
    def failed(self) -> bool:
        return self.executor is None or self.executor.failed

    @property
    def spec(self) -> Any:
        """The built pipeline's spec (None until built)."""
        return None if self.executor is None else self.executor.spec


# The executor that runs a member's pipeline, the cohort it joined and the cohort's run a batch
# makes are classes of modules built on this one (executor.py, cohorts.py): the members and
# batches here name them by what those who hold a member or a batch ask of them.


class Executor(Protocol):
    """The executor of a member's pipeline (``executor.PipelineExecutor``), as those that hold
    the member use it."""

    instance_id: int
    failed: bool
    spec: PipelineSpec | None

    @property
    def members(self) -> list[Member]: ...

    @property
    def window(self) -> int: ...

    def submit(self, batch: PendingBatch) -> None: ...

    def want(self, member: Member, batch_id: int) -> None: ...

    def sender_left(self, member: Member, first_id: int, end_id: int) -> None: ...

    def leave(self, member: Member) -> Stop: ...


class JoinedCohort(Protocol):
    """The cohort a member joined (``cohorts.Cohort``), as the I/O thread uses it."""

    name: str

    def take(self, batch: PendingBatch) -> tuple[Outcome, BatchReady | None]: ...

    def want(self, job_id: int, batch_id: int) -> None: ...

    def release(
        self,
        job_id: int,
        region_ids: Sequence[int],
        fence: str = "",
        closed_slabs: Sequence[str] = (),
    ) -> list[int]: ...

    def sender_left(self, job_id: int, first_id: int, end_id: int) -> None: ...

    def leave(self, member: Member, pid: int, namespace: int) -> None: ...


class CohortRun(Protocol):
    """The run a batch makes for its cohort (``cohorts.Entry``), as its executor uses it."""

    def write(
        self, outputs: Sequence[RunOutput], rows: range, source_stream: int | None
    ) -> tuple[OutputDescriptor, ...] | None: ...

    def account(self, seconds: float) -> None: ...

    def publish(
        self, descriptors: tuple[OutputDescriptor, ...], settle: Callable[[], None]
    ) -> list[tuple[PendingBatch, BatchReady | None]]: ...

    def take_recipients(self) -> list[PendingBatch]: ...

    def abandon(self) -> list[PendingBatch]: ...


@dataclass(eq=False)
class Run:
    """Batches that go into DALI together, in order; the first holds the scheduler's slot."""

    batches: list[PendingBatch]
    holder: int
    entered: float = 0.0

    @property
    def samples(self) -> int:
        return sum(batch.size for batch in self.batches)

    def rows(self) -> Iterator[tuple[PendingBatch, range]]:
        """Each batch with its rows of the run's outputs."""
        start = 0
        for batch in self.batches:
            yield batch, range(start, start + batch.size)
            start += batch.size

    def arrays(self) -> dict[str, np.ndarray | Sequence[np.ndarray]]:
        """The run's samples per input, batch after batch: one array where every batch's is
        one of the same sample shape, packed samples where every batch's are, else one
        list."""
        if len(self.batches) == 1:
            return self.batches[0].arrays
        names = self.batches[0].arrays.keys()
        return {name: _joined([batch.arrays[name] for batch in self.batches]) for name in names}


def _joined(
    parts: list[np.ndarray | Sequence[np.ndarray]],
) -> np.ndarray | Sequence[np.ndarray]:
    arrays = [part for part in parts if isinstance(part, np.ndarray)]
    if len(arrays) == len(parts) and len({array.shape[1:] for array in arrays}) == 1:
        return np.concatenate(arrays)
    packed = [part for part in parts if isinstance(part, PackedSamples)]
    if len(packed) == len(parts):
        return PackedSamples.joined(packed)
    return list(itertools.chain.from_iterable(parts))
