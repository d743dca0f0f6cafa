"""A job's registered pipelines as its batches find them: the registration a batch names, and
whether that registration's pipeline takes the batch, each refused with what to do."""

from __future__ import annotations

from dalid.protocol import ErrorCode, SubmitBatch

from ..errors import RequestRefused
from ..jobs.jobs import Job
from ..runs.runs import Member


def executor_for(job: Job, pipeline_id: int) -> Member:
    """The job's registration ``pipeline_id``, if its pipeline takes batches."""
    member = job.pipelines.get(pipeline_id)
    if member is None:
        raise RequestRefused(
            ErrorCode.UNKNOWN_PIPELINE, f"job {job.job_id} has no pipeline {pipeline_id}"
        )
    if member.failed:
        raise RequestRefused(
            ErrorCode.PIPELINE_ERROR,
            f"pipeline {pipeline_id} stopped working and takes no more batches (the daemon's "
            "log says why): register it again",
        )
    return member


def check_batch(member: Member, request: SubmitBatch) -> None:
    """Refuses a batch its pipeline cannot take."""
    spec = member.spec
    if spec is None:
        raise RequestRefused(
            ErrorCode.UNKNOWN_PIPELINE, f"pipeline {request.pipeline_id} is not built yet"
        )
    names = [item.name for item in request.inputs]
    if sorted(names) != sorted(spec.input_names):
        raise RequestRefused(
            ErrorCode.INVALID_BATCH,
            f"the batch has inputs {names}, the pipeline takes {list(spec.input_names)}",
        )
    if request.batch_size > spec.max_batch_size:
        raise RequestRefused(
            ErrorCode.INVALID_BATCH,
            f"batch of {request.batch_size} samples, over the pipeline's max_batch_size "
            f"{spec.max_batch_size}",
        )
