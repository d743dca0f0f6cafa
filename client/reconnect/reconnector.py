"""Daemon restarts, the trainer's side: how a job carries on when its daemon is replaced.

:class:`Reconnector` holds what a session has of the daemon it talks to now (a
:class:`~dalid.client.reconnect.generation.Generation`) and everything that outlives that
daemon: the pipelines' registrations, the jobs the session had on earlier daemons, and the
batches to submit again. A worker's side is ``dalid.client.worker.links``: its links by job,
which a restart takes away and gives back, and ``left_to_trainer``, which decides what becomes
of a batch the daemon refused. The daemon's half is in ``dalid.server``: a new daemon welcomes a
worker of an earlier job into the job of that job's trainer. The note below is the protocol all
three keep.

Note [Daemon restarts]
~~~~~~~~~~~~~~~~~~~~~~
A job with reconnect=True carries on across every way its daemon goes (a stop, an upgrade, a
kill, a crash, its supervisor's death), each batch delivered once, while a daemon comes back on
the socket within ``reconnect_timeout``; only ``dalid stop --end-jobs`` ends it. A daemon keeps
nothing across a restart, so the trainer, which outlives every daemon, carries it all:

1. a worker's batch reference carries the batch's inputs until the trainer delivers it, and a
   worker that finds the daemon gone leaves the batch to the trainer;
2. the trainer abandons a gone daemon's generation whole, connects again and registers its
   pipelines again, naming its earlier jobs and pipeline ids;
3. it submits again, from the inputs, every batch no live job accepted: once, never twice;
4. running workers rejoin the trainer's new job by their earlier job's identity.

The why, the stop notice, drain and the tests that hold it: docs/design/daemon-restarts.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from dalid.protocol import (
    MAX_EARLIER_JOBS,
    BatchFailed,
    Device,
    EarlierJob,
    EarlierPipeline,
    ErrorCode,
    PipelineRegistered,
    RegisterNamedPipeline,
    RegisterPipeline,
    Welcome,
)

from ..errors import (
    DaemonStopped,
    DaemonUnavailable,
    DalidError,
    InputError,
    ProtocolMismatch,
    RequestError,
)
from ..link.launcher import Dial
from ..link.link import Link
from ..worker.target import ProxyTarget
from .generation import Generation

if TYPE_CHECKING:
    from ..refs import DALIPipelineRunRef

log = logging.getLogger("dalid.client")

# How many times in a row one call may find the daemon gone and reconnect before it gives up.
MAX_RECONNECTS = 5

T = TypeVar("T")


class Retargetable(Protocol):
    """A proxy made for a registration (``worker.Proxy``): all a registration asks of it."""

    def retarget(self, target: ProxyTarget) -> None:
        """Points the proxy at another registration of the same pipeline (a new job)."""


@dataclass
class Registration:
    """A pipeline the session registered, kept to register it again with a new daemon."""

    request: RegisterPipeline | RegisterNamedPipeline
    deterministic: bool
    # The daemon's answer to the latest registration: the pipeline as it built it.
    registered: PipelineRegistered | None = None
    # The proxies made for it, pointed at each new registration.
    proxies: weakref.WeakSet[Retargetable] = field(default_factory=weakref.WeakSet)


class Reconnector:
    """A session's daemon, generation after generation: what the session's finalizer closes.

    Without ``enabled`` there is one generation, and a daemon found gone ends the session.
    With it, :meth:`call` reconnects to the daemon that comes back on the socket (waiting up to
    ``reconnect_timeout``) and tries again (Note [Daemon restarts]).
    """

    def __init__(
        self,
        dial: Dial,
        *,
        socket: Path,
        device: Device,
        enabled: bool,
        connect_timeout: float,
        reconnect_timeout: float = 60.0,
    ) -> None:
        self.socket = socket
        self.device = device
        self.enabled = enabled
        self._dial = dial
        # How long a reconnection waits for a daemon to come back on the socket.
        self._reconnect_timeout = reconnect_timeout
        self._registrations: list[Registration] = []
        # Every (job_token, pipeline_id) this session was given, in any daemon generation.
        self._pipeline_keys: dict[tuple[str, int], Registration] = {}
        # The jobs this session had on daemons it reconnected away from, oldest first, named
        # to each new daemon so that workers holding them join the new job.
        self._earlier_jobs: list[EarlierJob] = []
        self.reconnects = 0
        # Batches of DataLoader workers that the trainer submitted itself, from the inputs
        # their refs carry: those of a daemon that died, and those a worker could not send.
        self.submitted_by_trainer = 0
        self.generation = Generation.open(
            dial, connect_timeout=connect_timeout, hello_timeout=5.0, earlier_jobs=()
        )
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def welcome(self) -> Welcome:
        """The welcome of the daemon of the latest generation (closed or not)."""
        return self.generation.link.welcome

    @property
    def link(self) -> Link:
        if self._closed:
            raise DaemonUnavailable("this dalid session is closed")
        return self.generation.link

    def close(self) -> None:
        """Ends the job with the daemon of the latest generation. Idempotent."""
        if not self._closed:
            self._closed = True
            self.generation.close()

    def call(self, action: Callable[[], T]) -> T:
        """``action()``; when enabled, again after each reconnection to a new daemon."""
        gone = False
        stopped: DaemonStopped | None = None
        for attempt in range(MAX_RECONNECTS + 1):
            try:
                if gone:
                    self.reconnect_now(stopped)
                return action()
            except DaemonUnavailable as error:
                if (
                    not self.enabled
                    or isinstance(error, ProtocolMismatch)
                    or (isinstance(error, DaemonStopped) and error.ends_jobs)
                    or self._closed
                ):
                    raise
                if attempt == MAX_RECONNECTS:
                    raise DaemonUnavailable(
                        f"{error} (gave up after {MAX_RECONNECTS} reconnections in a row)"
                    ) from error
                # The text, not the exception: a record kept after this call (a buffering
                # handler, pytest's caplog) would keep the traceback's frames alive, and with
                # them the outputs this call goes on to deliver and their daemon's regions.
                stopped = error if isinstance(error, DaemonStopped) else None
                if stopped is not None:
                    # A stop is what an upgrade starts with: the next daemon may be on its way.
                    log.warning(
                        "%s: this job (reconnect=True) waits up to %.0f s for a new daemon on "
                        "that socket",
                        stopped.notice,
                        self._reconnect_timeout,
                    )
                else:
                    log.warning("%s: reconnecting", str(error))
                gone = True
        raise AssertionError("unreachable")

    def reconnect_now(self, stopped: DaemonStopped | None = None) -> None:
        """Abandons the daemon that is gone (``stopped``: it said why) and starts over with the
        one on the socket now, waiting for one up to the reconnect timeout."""
        welcome = self.welcome
        abandoned = EarlierJob(welcome.job_id, welcome.job_token)
        if abandoned not in self._earlier_jobs:
            # Past the limit the oldest goes: its workers (persistent ones, started that long
            # ago) then leave their batches to this session.
            self._earlier_jobs = [*self._earlier_jobs, abandoned][-MAX_EARLIER_JOBS:]
        self.generation.abandon()
        self._closed = True  # until a daemon welcomes the session
        deadline = time.monotonic() + self._reconnect_timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                generation = Generation.open(
                    self._dial,
                    connect_timeout=max(remaining, 1.0),
                    hello_timeout=min(max(remaining, 1.0), 5.0),
                    earlier_jobs=tuple(self._earlier_jobs),
                    # After a stop, whoever stopped the daemon starts the next (a service
                    # manager, an upgrade): a daemon autostarted here would take its socket.
                    may_start=stopped is None,
                )
                break
            except (DaemonUnavailable, RequestError) as error:
                # A daemon that lives on (it stopped answering pings for a while) may not have
                # ended our abandoned job yet, which holds an identity the hello claims; it
                # does once it notices that job's connection closed.
                if isinstance(error, RequestError) and error.code is not ErrorCode.JOB_CLAIMED:
                    raise
                if isinstance(error, ProtocolMismatch):
                    raise
                if time.monotonic() >= deadline:
                    raise self._none_came_back(stopped, error) from error
                time.sleep(0.2)
        self.generation = generation
        self._closed = False
        self.reconnects += 1
        log.warning(
            "reconnected to the dalid daemon on %s (pid %d), job %d",
            self.socket,
            self.welcome.daemon_pid,
            self.welcome.job_id,
        )
        for registration in self._registrations:
            self._register_now(registration)
            for proxy in registration.proxies:
                proxy.retarget(self.target_of(registration))

    def _none_came_back(
        self, stopped: DaemonStopped | None, error: DalidError
    ) -> DaemonUnavailable:
        waited = f"within {self._reconnect_timeout:.0f} s (the session's reconnect_timeout)"
        if stopped is not None:
            return DaemonStopped(
                f"{stopped.notice}, and no dalid daemon came back on {self.socket} {waited}: "
                "start one (`dalid serve`) and connect again",
                notice=stopped.notice,
            )
        return DaemonUnavailable(f"no dalid daemon came back on {self.socket} {waited}: {error}")

    # --- registrations ------------------------------------------------------------------------

    @property
    def registrations(self) -> tuple[Registration, ...]:
        """The session's pipelines, in the order it registered them."""
        return tuple(self._registrations)

    def register(
        self, request: RegisterPipeline | RegisterNamedPipeline, deterministic: bool
    ) -> Registration:
        """Registers a pipeline with the daemon, and again with each new one."""
        registration = Registration(request, deterministic)
        self.call(lambda: self._register_now(registration))
        self._registrations.append(registration)
        return registration

    def _register_now(self, registration: Registration) -> None:
        """Registers with the daemon connected now, naming the ids the pipeline had in the
        earlier jobs this session names at hello."""
        earlier = {job.job_token for job in self._earlier_jobs}
        request = dataclasses.replace(
            registration.request,
            earlier_ids=tuple(
                EarlierPipeline(token, pipeline_id)
                for (token, pipeline_id), known in self._pipeline_keys.items()
                if known is registration and token in earlier
            ),
        )
        link = self.link
        reply = link.request(request)
        assert isinstance(reply, PipelineRegistered)
        registration.registered = reply
        self._pipeline_keys[(link.welcome.job_token, reply.pipeline_id)] = registration

    def target_of(self, registration: Registration) -> ProxyTarget:
        """Where a proxy sends its batches: the pipeline as the daemon built it."""
        welcome = self.link.welcome
        registered = registration.registered
        assert registered is not None
        return ProxyTarget(
            socket=self.socket,
            device=self.device,
            job_id=welcome.job_id,
            job_token=welcome.job_token,
            pipeline_id=registered.pipeline_id,
            input_names=registered.input_names,
            num_outputs=registered.num_outputs,
            max_batch_size=registered.max_batch_size,
            deterministic=registration.deterministic,
            reconnect=self.enabled,
            path_inputs=registered.path_inputs,
            working_directory=os.getcwd(),
        )

    # --- batches ----------------------------------------------------------------------------------

    def check(self, run: DALIPipelineRunRef) -> None:
        """Raises :class:`InputError` for a batch reference the session cannot deliver."""
        kept = run.resubmission is not None and bool(run.resubmission.inputs)
        if run.batch_id is None and not (self.enabled and kept):
            raise InputError(
                "a batch reference that was never submitted: collate the proxy's sample "
                "references (torch's default collate does) before produce_data"
            )
        if (run.job_token, run.pipeline_id) not in self._pipeline_keys:
            raise InputError(
                f"batch {run.batch_id} belongs to job {run.job_id}, not to this session's "
                f"job {self.welcome.job_id}"
            )

    def submit_if_lost(self, run: DALIPipelineRunRef) -> None:
        """Submits the batch to the daemon connected now unless one of its jobs accepted it:
        a batch of an abandoned daemon, or one a worker could not send."""
        accepted_by = run.resubmission.accepted_by if run.resubmission is not None else None
        if run.batch_id is not None and accepted_by in (None, self.link.welcome.job_token):
            return
        registration = self._pipeline_keys[(run.job_token, run.pipeline_id)]
        if run.resubmission is None or not run.resubmission.inputs:
            # Not DaemonUnavailable: reconnecting again would not bring the inputs back.
            raise InputError(
                f"batch {run.batch_id} was lost with the daemon on {self.socket} and its inputs "
                "are gone: it was delivered already, or its proxy was made by another session"
            )
        link = self.link
        request = self.target_of(registration).submission(
            run.resubmission.inputs, run.deterministic, self.generation.next_batch_id()
        )
        # Waited for: the trainer's link has no submitter of its own to settle it later.
        reply = link.request(request)
        if isinstance(reply, BatchFailed):
            self.generation.results[reply.batch_id] = reply  # raised when it is waited for
        welcome = link.welcome
        run.job_id, run.job_token = welcome.job_id, welcome.job_token
        run.pipeline_id, run.batch_id = request.pipeline_id, request.batch_id
        run.resubmission.accepted_by = welcome.job_token
        run.is_scheduled = not run.deterministic
        self.submitted_by_trainer += 1

    def resubmit_refused(self, run: DALIPipelineRunRef, failed: BatchFailed) -> bool:
        """Submits again a batch of a worker that rejoined this job before the trainer had
        registered its pipeline again (a rejoined worker's); whether it did."""
        resubmission = run.resubmission
        if (
            failed.code is not ErrorCode.UNKNOWN_PIPELINE
            or resubmission is None
            or not resubmission.inputs
            or run.deterministic  # a deferred batch's refusal reached its worker instead
            # Accepted by the trainer's job for a proxy of an earlier one: a rejoined worker.
            or resubmission.accepted_by in ("", run.job_token)
        ):
            return False
        resubmission.accepted_by = ""
        self.submit_if_lost(run)
        return True

    @staticmethod
    def delivered(run: DALIPipelineRunRef) -> None:
        """The batch's outputs are delivered: the inputs kept for a resubmission can go."""
        if run.resubmission is not None:
            run.resubmission.inputs = {}
