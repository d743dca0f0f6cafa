"""The refusal a request handler raises; the daemon answers it as an ``error`` reply."""

from __future__ import annotations

from dalid.protocol import ErrorCode


class RequestRefused(Exception):
    """A request the daemon answers with an error reply of ``code``, saying what to do."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
