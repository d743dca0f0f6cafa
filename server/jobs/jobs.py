"""The daemon's jobs, the connections that belong to them, and which job a hello names.

A job is opened by its trainer's ``hello`` and ends when the trainer says goodbye, its
connection closes or its process is gone; DataLoader workers join it by its id and secret token.
:class:`JobRegistry` owns the jobs and peers of one daemon and is the one place that resolves
an (id, token) pair, its aliases after daemon restarts included.

The daemon's half of Note [Daemon restarts] (docs/design/daemon-restarts.md; SPEC.md
"Restarts" is the contract): a daemon keeps nothing across a restart, and the trainer carries
its jobs' identities from one daemon to the next.

1. The jobs a trainer's ``hello`` names (``earlier_jobs``) become aliases of its new job: a
   worker naming one, with its token, joins the new job (:meth:`JobRegistry.named`).
2. An alias names one job: a claim on a live job or another job's alias is refused with
   ``job_claimed`` (:meth:`JobRegistry.check_unclaimed`); the trainer tries again.
3. A registration names the pipeline's ids in the earlier jobs its hello claimed
   (:meth:`Job.check_earlier_ids`); a rejoined worker's batch names its pipeline so.
4. Aliases go when the job ends, with everything else it held.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dalid.protocol import (
    EarlierJob,
    ErrorCode,
    Hello,
    Limits,
    ProcessWatch,
    RegisterNamedPipeline,
    RegisterPipeline,
    Role,
    SubmitBatch,
    process_running,
)

from ..errors import RequestRefused
from ..outputs.job_outputs import JobOutputs
from ..runs.stopping import Stop, wait_for
from .admission import Admission, WaitingBatch
from .batch_ids import BatchIds
from .rates import RateMeter

if TYPE_CHECKING:
    from ..runs.runs import Member, PendingBatch

log = logging.getLogger("dalid.server")


@dataclass
class Job:
    """One training job: its trainer connection, pipelines, deferred batches and outputs.

    ``admission`` holds its batches in flight and those waiting over its limit; ``outputs``
    the memory its outputs are delivered in.
    """

    job_id: int
    token: str
    trainer: bytes
    pid: int
    pid_namespace: int
    name: str
    limits: Limits
    outputs: JobOutputs
    admission: Admission
    # Its registrations by the job's pipeline ids (pipelines may be shared with other jobs).
    pipelines: dict[int, Member] = field(default_factory=dict)
    deferred: dict[int, PendingBatch] = field(default_factory=dict)
    peers: set[bytes] = field(default_factory=set)
    closed: bool = False
    batches_failed: int = 0
    # Batches delivered as private copies (Note [Private copies] in copies.py).
    batches_copied: int = 0
    batches_copied_on_device: int = 0
    meter: RateMeter = field(default_factory=RateMeter)
    trainer_waited: float = 0.0
    # The DataLoader workers its trainer says its loaders started (LoaderWorkers); None until
    # it says (an older trainer never does).
    workers_started: int | None = None
    connected_at: float = field(default_factory=time.monotonic)
    # The jobs its trainer had on earlier daemons of the socket (Hello.earlier_jobs).
    earlier_jobs: tuple[EarlierJob, ...] = ()
    # (earlier job's token, a pipeline's id in that job) -> the pipeline's id in this job.
    earlier_pipelines: dict[tuple[str, int], int] = field(default_factory=dict)
    # The stops of its pipelines, once it is closed.
    stops: list[Stop] = field(default_factory=list)
    # The uid of its trainer's process as its socket tells (-1: unknown).
    uid: int = -1
    # When a batch of it was last submitted, scheduled, wanted, released or delivered, or a
    # pipeline registered (monotonic; set once a batch): reclaim.py ends the job idle longest
    # when a newcomer finds no place.
    active_at: float = field(default_factory=time.monotonic)

    @property
    def busy(self) -> bool:
        """Whether it has batches in flight, waiting for their turn or deferred."""
        return bool(self.deferred) or self.admission.busy

    def close(self) -> list[WaitingBatch]:
        """Stops the job's pipelines, without waiting long for them (``stopping``, then
        :meth:`close_outputs`). Idempotent. Returns the batches that still waited for
        admission."""
        if self.closed:
            return []
        self.closed = True
        waiting = self.admission.close()
        self.stops = [
            member.executor.leave(member)
            for member in self.pipelines.values()
            if member.executor is not None
        ]
        self.pipelines.clear()
        self.deferred.clear()
        wait_for(self.stops)  # a moment at most (Note [A pipeline stuck inside DALI])
        return waiting

    @property
    def stopping(self) -> bool:
        """Whether a stop of its pipelines is still under way (Note [A pipeline stuck inside
        DALI] in runs/stopping.py): its outputs are closed once it has finished."""
        return not all(stop.finished for stop in self.stops)

    def close_outputs(self) -> bool:
        """Closes its outputs; whether memory is left that the trainer still maps (freed by
        ``outputs.free()`` once it is gone)."""
        # An executor stuck inside DALI may still write its outputs: keep the memory mapped.
        return self.outputs.close(unmap=all(stop.stopped for stop in self.stops))

    # --- earlier pipeline ids (Note [Daemon restarts]) ----------------------------------------

    def check_earlier_ids(self, request: RegisterPipeline | RegisterNamedPipeline) -> None:
        """Refuses a registration naming an earlier job that this job's hello did not claim."""
        claimed = {earlier.job_token for earlier in self.earlier_jobs}
        for earlier in request.earlier_ids:
            if earlier.job_token not in claimed:
                raise RequestRefused(
                    ErrorCode.UNKNOWN_JOB,
                    f"{request.OP}: earlier_ids names a job that the hello of job {self.job_id} "
                    "did not name in earlier_jobs",
                )

    def adopt_earlier_ids(
        self, request: RegisterPipeline | RegisterNamedPipeline, pipeline_id: int
    ) -> None:
        """Makes the registration's earlier ids name ``pipeline_id`` (the latest one wins)."""
        for earlier in request.earlier_ids:
            self.earlier_pipelines[(earlier.job_token, earlier.pipeline_id)] = pipeline_id

    def pipeline_in_this_job(self, earlier_token: str, request: SubmitBatch) -> SubmitBatch:
        """A batch of a worker that joined as an earlier job, naming its pipeline by the id it
        has in this job."""
        pipeline_id = self.earlier_pipelines.get((earlier_token, request.pipeline_id))
        if pipeline_id is None:
            raise RequestRefused(
                ErrorCode.UNKNOWN_PIPELINE,
                f"job {self.job_id} has not registered again pipeline {request.pipeline_id} of "
                "its earlier job (yet)",
            )
        return dataclasses.replace(request, pipeline_id=pipeline_id)


@dataclass
class Peer:
    """One connection: a job's trainer or one of its workers."""

    identity: bytes
    role: Role
    job: Job
    pid: int
    pid_namespace: int
    # A worker that joined as an earlier job of its trainer: that job's token. Its batches name
    # pipelines by their ids in that job.
    earlier_token: str = ""
    # The ids its batches may take (batch_ids.py).
    batch_ids: BatchIds = field(default_factory=BatchIds)


class JobRegistry:
    """The jobs and peers of one daemon, by id and by connection; their liveness.

    Used from the I/O thread, except ``lingering``, which ``reap`` and ``close`` share with it.
    It watches the process of every job and peer of this pid namespace while it knows them (a
    pidfd each, held by its :class:`ProcessWatch` until the job or peer is forgotten, and
    closed by :meth:`close`): a look at whether any has exited is one ``poll``.
    """

    def __init__(self, pid_namespace: int) -> None:
        self.jobs: dict[int, Job] = {}
        self.peers: dict[bytes, Peer] = {}
        self._next_job_id = 1
        # Jobs removed so far.
        self.ended = 0
        self._pid_namespace = pid_namespace
        # Ended jobs whose trainer still maps some of their output memory: freed once it exits.
        self._lingering: list[Job] = []
        self._lock = threading.Lock()
        self._watch = ProcessWatch()
        # Jobs and peers whose process it cannot watch (another pid namespace, or none seen).
        self._unwatched = 0

    def _watched(self, pid: int, namespace: int) -> int:
        """The pid to watch for a process of ``namespace``; 0 (none) where the pid means nothing
        here or is not known (see :meth:`alive`)."""
        return pid if namespace == self._pid_namespace and pid > 0 else 0

    def _follow(self, pid: int, namespace: int) -> None:
        """Watches a new job's or peer's process, or counts one it cannot watch."""
        watched = self._watched(pid, namespace)
        if watched:
            self._watch.watch(watched)
        else:
            self._unwatched += 1

    def _unfollow(self, pid: int, namespace: int) -> None:
        watched = self._watched(pid, namespace)
        if watched:
            self._watch.unwatch(watched)
        else:
            self._unwatched -= 1

    def _dead(self, pid: int, namespace: int, exited: set[int]) -> bool:
        """Whether a job's or peer's process has gone: a watched one by the watch's ``exited``,
        another as :meth:`alive` says."""
        watched = self._watched(pid, namespace)
        return watched in exited if watched else not self.alive(pid, namespace)

    def open(
        self,
        trainer: bytes,
        hello: Hello,
        limits: Limits,
        outputs: Callable[[int], JobOutputs],
        max_waiting_batches: int,
        *,
        pid: int,
        uid: int = -1,
    ) -> Job:
        """A new job for a trainer's hello, granted ``limits``; ``outputs(job_id)`` makes its
        output stores. ``pid``: the trainer's process as its socket tells (the hello's pid is
        the client's word, and decides nothing), 0 where this daemon cannot see it; ``uid`` its user
        (-1: unknown)."""
        job_id = self._next_job_id
        self._next_job_id += 1
        job = Job(
            job_id=job_id,
            token=secrets.token_hex(16),
            trainer=trainer,
            pid=pid,
            pid_namespace=self._pid_namespace,
            name=hello.name,
            limits=limits,
            outputs=outputs(job_id),
            admission=Admission(job_id, limits.max_inflight_batches, max_waiting_batches),
            earlier_jobs=hello.earlier_jobs,
            uid=uid,
        )
        self.jobs[job_id] = job
        self._follow(pid, job.pid_namespace)
        return job

    def join(
        self, identity: bytes, hello: Hello, job: Job, pid: int, earlier_token: str = ""
    ) -> Peer:
        """Makes the connection ``identity``, of process ``pid`` (as for :meth:`open`), a peer
        of ``job``."""
        peer = Peer(identity, hello.role, job, pid, self._pid_namespace, earlier_token)
        job.peers.add(identity)
        self.peers[identity] = peer
        self._follow(pid, peer.pid_namespace)
        return peer

    def trainers(self) -> list[tuple[bytes, int]]:
        """Each trainer's connection and the pid of its process (0: not seen from here)."""
        return [(p.identity, p.pid) for p in self.peers.values() if p.role is Role.TRAINER]

    def forget_peer(self, identity: bytes) -> None:
        peer = self.peers.pop(identity, None)
        if peer is not None:
            peer.job.peers.discard(identity)
            self._unfollow(peer.pid, peer.pid_namespace)

    def job_for(self, identity: bytes) -> Job | None:
        peer = self.peers.get(identity)
        return peer.job if peer else None

    def remove(self, job: Job) -> None:
        """Forgets a job and its peers (the caller closes it)."""
        for identity in list(job.peers):
            peer = self.peers.pop(identity, None)
            if peer is not None:
                self._unfollow(peer.pid, peer.pid_namespace)
        if self.jobs.pop(job.job_id, None) is not None:
            self.ended += 1
            self._unfollow(job.pid, job.pid_namespace)

    # --- earlier jobs as aliases (Note [Daemon restarts]) -------------------------------------

    def named(self, job_id: int, token: str) -> tuple[Job, str] | None:
        """The job that (``job_id``, ``token``) names, and "" for a live job of this daemon or
        the token of the earlier job it names; None if none."""
        live = self.jobs.get(job_id)
        if live is not None and _same_token(live.token, token):
            return live, ""
        for job in self.jobs.values():
            for earlier in job.earlier_jobs:
                if earlier.job_id == job_id and _same_token(earlier.job_token, token):
                    return job, earlier.job_token
        return None

    def check_unclaimed(self, earlier_jobs: tuple[EarlierJob, ...]) -> None:
        """Refuses a trainer's claim on an earlier job that already names a job here: two jobs
        answering to one identity would let one's workers into the other."""
        for earlier in earlier_jobs:
            found = self.named(earlier.job_id, earlier.job_token)
            if found is not None:
                owner, earlier_token = found
                raise RequestRefused(
                    ErrorCode.JOB_CLAIMED,
                    f"earlier job {earlier.job_id} with that token is "
                    + (f"claimed by job {owner.job_id}" if earlier_token else "a live job")
                    + " on this daemon: a job's identity belongs to one trainer",
                )

    # --- liveness -------------------------------------------------------------------------------

    def alive(self, pid: int, namespace: int) -> bool:
        """Whether a peer's process lives, as far as this daemon can tell."""
        if not self._watched(pid, namespace):
            return True  # another pid namespace: its pid means nothing here
        return process_running(pid)

    def dead_workers(self) -> list[bytes]:
        """The workers whose process has exited (one look at every watched process)."""
        exited = self._watch.exited()
        if not exited and not self._unwatched:
            return []
        return [
            identity
            for identity, peer in self.peers.items()
            if peer.role is Role.WORKER and self._dead(peer.pid, peer.pid_namespace, exited)
        ]

    def dead_jobs(self) -> list[Job]:
        """The jobs whose trainer process has exited."""
        exited = self._watch.exited()
        if not exited and not self._unwatched:
            return []
        return [job for job in self.jobs.values() if self._dead(job.pid, job.pid_namespace, exited)]

    def linger(self, job: Job) -> None:
        """Keeps an ended job's outputs until its trainer process is gone."""
        with self._lock:
            self._lingering.append(job)

    def take_lingering(self, everything: bool = False) -> list[Job]:
        """The lingering jobs whose trainer is gone (``everything``: all of them), forgotten."""
        with self._lock:
            if not self._lingering:
                return []
            # Few, and only on a GPU daemon: each is asked about on its own (``alive``).
            gone = [
                job
                for job in self._lingering
                if everything or not self.alive(job.pid, job.pid_namespace)
            ]
            self._lingering = [job for job in self._lingering if job not in gone]
        return gone

    def close(self) -> None:
        """Stops watching every process (their pidfds closed). Idempotent."""
        self._watch.close()


def _same_token(expected: str, given: str) -> bool:
    """Compares a secret token in constant time (as bytes: ``given`` may be any string)."""
    return hmac.compare_digest(expected.encode(), given.encode())


def job_label(name: str, pid: int) -> str:
    """How the log names a job once, at connect: its name and its trainer's pid (the client's
    default name is the pid, said once)."""
    return f"{name}, pid {pid}" if name and name != f"pid {pid}" else f"pid {pid}"
