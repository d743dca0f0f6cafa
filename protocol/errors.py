"""Error codes that travel on the wire.

An error is data: a code from :class:`ErrorCode`, a human-readable message and, where the daemon
caught an exception, its traceback as a string. Nothing is pickled, so any language can read it.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Why a request failed. The wire carries the string value."""

    # The message itself could not be understood.
    MALFORMED_MESSAGE = "malformed_message"
    PROTOCOL_MISMATCH = "protocol_mismatch"
    UNKNOWN_OPERATION = "unknown_operation"
    # The sender is not (or no longer) allowed to do this.
    NOT_WELCOMED = "not_welcomed"
    UNKNOWN_JOB = "unknown_job"
    # A trainer's hello named an earlier job that is a live job here, or another job's claim.
    JOB_CLAIMED = "job_claimed"
    # The request named something that does not exist or does not fit.
    UNKNOWN_PIPELINE = "unknown_pipeline"
    UNKNOWN_BATCH = "unknown_batch"
    UNKNOWN_REGION = "unknown_region"
    INVALID_PIPELINE = "invalid_pipeline"
    DEVICE_MISMATCH = "device_mismatch"
    INVALID_BATCH = "invalid_batch"
    # Running the batch failed.
    PIPELINE_ERROR = "pipeline_error"
    # Some samples failed on their own (corrupt, unsupported, too large); the batch names them.
    BAD_SAMPLES = "bad_samples"
    INVALID_OUTPUT = "invalid_output"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    # The daemon itself.
    SHUTTING_DOWN = "shutting_down"
    INTERNAL_ERROR = "internal_error"


class ProtocolError(ValueError):
    """A message that does not follow the protocol; ``code`` says how."""

    def __init__(
        self, code: ErrorCode, message: str, request_id: int | None = None, op: str = ""
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # Where the header could be read, the reply goes back to this request.
        self.request_id = request_id
        self.op = op
