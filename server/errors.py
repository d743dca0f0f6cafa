"""The refusal a request handler raises; the daemon answers it as an ``error`` reply."""

from __future__ import annotations

from dalid.protocol import ErrorCode


class RequestRefused(Exception):
    """A request the daemon answers with an error reply of ``code``, saying what to do.
    ``ends_jobs``: with ``unknown_job``, the job the request names was ended by the daemon
    (reclaimed as idle), and the message says why."""

    def __init__(self, code: ErrorCode, message: str, *, ends_jobs: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.ends_jobs = ends_jobs
