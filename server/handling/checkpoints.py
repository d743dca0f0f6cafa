"""The daemon's handlers of a deterministic job's pipeline checkpoints: ``checkpoint_pipeline``
takes the DALI checkpoint of the job's own pipeline between two of its runs, and
``restore_pipeline`` puts a new pipeline in that state before its first run (SPEC.md,
"Checkpoints"; docs/design/checkpoints.md).

A deterministic job's batches run only when its trainer schedules them, one at a time, in the
order it asks for their outputs; the batches its workers submitted ahead wait deferred, outside
DALI. So when the trainer, having received its k-th batch, asks for the checkpoint, the pipeline
has run exactly those k batches: the checkpoint is the state at that boundary, and the batches
submitted ahead run after a resume as they would have.
"""

from __future__ import annotations

from collections.abc import Mapping

from dalid.protocol import (
    CheckpointPipeline,
    ErrorCode,
    Message,
    Ok,
    PipelineCheckpoint,
    RestorePipeline,
)

from ..errors import RequestRefused
from ..jobs.jobs import Job, Peer
from ..pipelines.checkpoints import CheckpointUnavailable
from ..pipelines.runner import PipelineRunner
from ..runs.executor import PipelineExecutor
from .members import executor_for


class Checkpoints:
    """Handles ``checkpoint_pipeline`` and ``restore_pipeline`` for a connection in a job."""

    def __init__(self, peers: Mapping[bytes, Peer]) -> None:
        self._peers = peers

    def on_checkpoint_pipeline(
        self, identity: bytes, request: CheckpointPipeline, _request_id: int | None
    ) -> Message:
        runner = self._runner(self._peers[identity].job, request.pipeline_id)
        try:
            checkpoint, runs = runner.checkpoint()
        except CheckpointUnavailable as why:
            return PipelineCheckpoint(request.pipeline_id, memoryview(b""), 0, str(why))
        return PipelineCheckpoint(request.pipeline_id, memoryview(checkpoint), runs)

    def on_restore_pipeline(
        self, identity: bytes, request: RestorePipeline, _request_id: int | None
    ) -> Message:
        runner = self._runner(self._peers[identity].job, request.pipeline_id)
        try:
            runner.restore(bytes(request.checkpoint))
        except CheckpointUnavailable as why:
            raise RequestRefused(ErrorCode.INVALID_PIPELINE, str(why)) from None
        return Ok()

    @staticmethod
    def _runner(job: Job, pipeline_id: int) -> PipelineRunner:
        member = executor_for(job, pipeline_id)
        if not member.deterministic:
            raise RequestRefused(
                ErrorCode.INVALID_PIPELINE,
                f"pipeline {pipeline_id} is not deterministic: its runs go ahead of the trainer "
                "(and may mix jobs' batches), so no checkpoint of it stands between two of its "
                "batches; register it with deterministic=True",
            )
        executor = member.executor
        runner = executor.runner if isinstance(executor, PipelineExecutor) else None
        if runner is None:
            raise RequestRefused(
                ErrorCode.UNKNOWN_PIPELINE, f"pipeline {pipeline_id} is not built yet"
            )
        return runner
