"""The exceptions a dalid user sees, mapped from the daemon's error codes.

Two families: :class:`RequestError` (this request or batch failed; the session goes on) and
:class:`DaemonUnavailable` (no daemon answers; nothing more will arrive on this session).

Where DALI's proxy raises ``RuntimeError`` (a batch that fails, a pipeline that cannot be built
or run on this device), dalid's error is a ``RuntimeError`` too, so that code written for DALI's
proxy catches it as it did; where DALI raises ``ValueError`` (the proxy called with arguments
its pipeline does not take), :class:`InputError` is one.
"""

from __future__ import annotations

from dalid.protocol import BadSample, Error, ErrorCode


class DalidError(Exception):
    """Base of every dalid error."""


class RequestError(DalidError, RuntimeError):
    """The daemon refused or could not carry out a request; the session stays usable."""

    def __init__(self, code: ErrorCode, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.traceback = traceback


class InputError(DalidError, ValueError):
    """Bad arguments found in the caller, before anything was sent to the daemon."""


class PipelineError(RequestError):
    """The daemon could not build the pipeline (including a device it does not serve, and a
    name its pipeline repository does not have)."""


class BatchError(RequestError):
    """A batch could not be run; the message carries DALI's own.

    ``bad_samples`` names the samples that fail on their own (code ``bad_samples``), by position
    in the batch as collated; ``dataset_indices`` their indices in the dataset and ``step`` the
    loader's step (as ``enumerate(loader)`` counts), where dalid's DataLoader knows them (None
    otherwise). ``batch_id`` is the batch's id (its submitter chose it), as the daemon's log
    names it. A batch the daemon refused after its worker had sent it fails this way too.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        batch_id: int,
        pipeline_id: int,
        bad_samples: tuple[BadSample, ...] = (),
    ) -> None:
        super().__init__(code, message)
        self.reason = message
        self.batch_id = batch_id
        self.pipeline_id = pipeline_id
        self.bad_samples = bad_samples
        self.dataset_indices: list[int] | None = None
        self.step: int | None = None
        # The dataset indices of the whole batch, where dalid's DataLoader knows them.
        self.batch_indices: list[int] | None = None
        self.args = (self._describe(),)

    @property
    def positions(self) -> list[int]:
        """Positions in the batch of the bad samples."""
        return [sample.position for sample in self.bad_samples]

    def locate(self, step: int | None, batch_indices: list[int] | None) -> None:
        """Names the batch by the loader's ``step`` and its bad samples by dataset index,
        given the indices of the whole batch."""
        self.step = step
        self.batch_indices = batch_indices
        if batch_indices is not None:
            self.dataset_indices = [
                batch_indices[p] for p in self.positions if p < len(batch_indices)
            ]
        self.args = (self._describe(),)

    def _describe(self) -> str:
        # Named as the daemon's log names it: pipeline (the job's registration) and batch id.
        daemon = f"pipeline {self.pipeline_id} batch {self.batch_id}"
        where = (
            daemon
            if self.step is None
            else f"loader step {self.step} ({daemon} in the daemon's log)"
        )
        if self.code in _DALI_FAILURES:
            # DALI's proxy raises DALI's own error, which starts so; code may match its words.
            where = f"Critical error in pipeline: {where}"
        if not self.bad_samples:
            return f"{where}{_indices(self.batch_indices)} failed: {self.reason}"
        indices = self.dataset_indices or []
        samples = "; ".join(
            f"sample {bad.position}"
            + (f" (dataset index {indices[n]})" if n < len(indices) else "")
            + f": {bad.message}"
            for n, bad in enumerate(self.bad_samples)
        )
        every = "every sample of the batch is bad: " if self.reason.startswith("every ") else ""
        count = len(self.bad_samples)
        return f"{where} failed, {every}{count} bad sample{'s' * (count != 1)}: {samples}"


def _indices(indices: list[int] | None, shown: int = 8) -> str:
    """The dataset indices of a batch, the first ``shown`` of them ("" if unknown)."""
    if not indices:
        return ""
    listed = ", ".join(str(index) for index in indices[:shown])
    more = f", ... ({len(indices)} samples)" if len(indices) > shown else ""
    return f", dataset indices {listed}{more},"


class DeviceMismatch(DalidError, RuntimeError):
    """This process cannot use the GPU the daemon delivers outputs on (another GPU, no CUDA)."""


class DaemonUnavailable(DalidError, RuntimeError):
    """No daemon answers on the socket, or the one that did has gone."""


class ProtocolMismatch(DaemonUnavailable):
    """The daemon speaks another protocol version than this client."""


class DaemonStopped(DaemonUnavailable):
    """The daemon was stopped (``dalid stop``, SIGTERM, its supervisor's death) and said why
    before it went. A session with ``reconnect`` waits for the next daemon on its socket, as
    across an upgrade, unless the daemon ended its jobs (``ends_jobs``: ``dalid stop
    --end-jobs``); ``notice`` is what the daemon said."""

    def __init__(self, message: str, *, notice: str = "", ends_jobs: bool = False) -> None:
        super().__init__(message)
        self.notice = notice or message
        self.ends_jobs = ends_jobs


class JobEnded(DaemonUnavailable):
    """The daemon ended this job while the daemon itself runs on: it had been idle (no batch
    for the daemon's ``--reclaim-idle-s``) when another job needed its place. A session with
    ``reconnect`` connects again at its next call, as a new job (refused while the daemon stays
    full); the message says why and what to do."""


def ended_notice(notice: Error) -> JobEnded | None:
    """The error for a daemon's word that it ended this connection's job, else None: an
    ``error`` ``unknown_job`` with ``ends_jobs``, pushed with no request id, or the reply to a
    worker's hello that names the job after it ended."""
    if notice.code is ErrorCode.UNKNOWN_JOB and notice.ends_jobs:
        return JobEnded(f"the dalid daemon ended this job: {notice.message}")
    return None


def stopped_error(
    notice: Error, then: str = "start a daemon again (`dalid serve`), then connect again"
) -> DaemonStopped:
    """The error a job without ``reconnect`` (or one whose jobs were ended) raises for a
    daemon's stop notice; ``then``: what the job's user can do next."""
    said = notice.message
    if notice.ends_jobs:
        message = f"{said}, and ended this job: {then}"
    else:
        message = (
            f"{said}, which ends a job without reconnect=True: {then}; a job connected with "
            "reconnect=True waits for the next daemon on its socket instead (an upgrade is a "
            "stop followed by a new daemon)"
        )
    return DaemonStopped(message, notice=said, ends_jobs=notice.ends_jobs)


# A batch that DALI ran and that failed there (not one the daemon refused).
_DALI_FAILURES = {ErrorCode.PIPELINE_ERROR, ErrorCode.BAD_SAMPLES}

_PIPELINE_CODES = {
    ErrorCode.INVALID_PIPELINE,
    ErrorCode.DEVICE_MISMATCH,
    ErrorCode.UNKNOWN_PIPELINE,
}


def error_from_reply(reply: Error) -> DalidError:
    """The exception for an error reply."""
    if reply.code is ErrorCode.PROTOCOL_MISMATCH:
        return ProtocolMismatch(reply.message)
    if reply.code is ErrorCode.SHUTTING_DOWN:
        return stopped_error(reply)
    ended = ended_notice(reply)
    if ended is not None:
        return ended
    cls = PipelineError if reply.code in _PIPELINE_CODES else RequestError
    return cls(reply.code, reply.message, reply.traceback)
