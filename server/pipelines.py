"""Registering a job's pipelines, and which of them takes a batch.

A registration names a client's serialized pipeline (``register_pipeline``) or a pipeline of the
daemon's repository (``register_named_pipeline``). :class:`PipelineBuilder` starts an executor
for it (``executor.py``), which builds the pipeline in its own thread so that a slow build holds
up no other job; the reply leaves once it is built.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable

from dalid.protocol import (
    Error,
    ErrorCode,
    Message,
    PipelineRegistered,
    RegisterNamedPipeline,
    RegisterPipeline,
    SubmitBatch,
)

from .errors import RequestRefused
from .executor import Answer, PipelineExecutor
from .jobs import Job
from .reload import LiveRepository
from .runner import PipelineBuildError, PipelineRunner, PipelineSpec
from .scheduler import FairScheduler, JobSlots

log = logging.getLogger("dalid.server")

Push = Callable[[bytes, Message, int | None], None]


class PipelineBuilder:
    """Builds the pipelines jobs register, for ``device_id`` (None: CPU pipelines only)."""

    def __init__(
        self,
        device_id: int | None,
        max_batch_size: int,
        repository: LiveRepository,
        scheduler: FairScheduler,
        push: Push,
    ) -> None:
        self._device_id = device_id
        self._max_batch_size = max_batch_size
        self._repository = repository
        self._scheduler = scheduler
        self._push = push
        self._next_pipeline_id = 1

    def start(
        self,
        job: Job,
        request: RegisterPipeline | RegisterNamedPipeline,
        request_id: int | None,
        answer: Answer,
    ) -> int:
        """Starts the pipeline's executor for ``job``; its id. The trainer's reply leaves once
        the pipeline is built; ``answer`` gets its batches' results."""
        make_runner = self._runner_of(request)
        pipeline_id = self._next_pipeline_id
        self._next_pipeline_id += 1
        job.adopt_earlier_ids(request, pipeline_id)
        trainer = job.trainer

        def on_built(result: PipelineSpec | PipelineBuildError) -> None:
            # Runs in the executor's thread: the reply leaves through the outbox.
            if isinstance(result, PipelineSpec):
                log.info("job %d registered pipeline %d %r", job.job_id, pipeline_id, result.name)
                reply: Message = PipelineRegistered(
                    pipeline_id,
                    input_names=result.input_names,
                    num_outputs=result.num_outputs,
                    max_batch_size=result.max_batch_size,
                )
            else:
                log.info("job %d: pipeline %r not built: %s", job.job_id, request.name, result)
                reply = Error(result.code, str(result), op=request.OP)
            self._push(trainer, reply, request_id)

        job.pipelines[pipeline_id] = PipelineExecutor(
            pipeline_id,
            make_runner,
            outputs=job.outputs,
            answer=answer,
            on_built=on_built,
            slots=JobSlots(self._scheduler, job.job_id),
            max_image_pixels=job.limits.max_image_pixels,
        )
        return pipeline_id

    def _runner_of(
        self, request: RegisterPipeline | RegisterNamedPipeline
    ) -> Callable[[], PipelineRunner]:
        """What builds the registered pipeline, in the executor's thread."""
        if isinstance(request, RegisterPipeline):
            if request.max_batch_size > self._max_batch_size:
                raise RequestRefused(
                    ErrorCode.INVALID_PIPELINE,
                    f"max_batch_size {request.max_batch_size} is over this daemon's limit of "
                    f"{self._max_batch_size}",
                )
            spec = PipelineSpec.from_message(request)
            return functools.partial(PipelineRunner, spec, self._device_id)
        parameters = json.loads(request.parameters)
        build_arguments = {
            name: getattr(request, name)
            for name in ("batch_size", "num_threads", "prefetch_queue_depth", "seed")
            if getattr(request, name) is not None
        }
        build_arguments["device_id"] = self._device_id
        try:
            # Read once, now: a reload meanwhile does not change what this registration builds.
            definition = self._repository.current.definition(
                request.name, build_arguments, parameters
            )
        except KeyError as error:
            raise RequestRefused(ErrorCode.UNKNOWN_PIPELINE, error.args[0]) from None
        return functools.partial(
            PipelineRunner.from_definition,
            request.name,
            definition,
            self._device_id,
            self._max_batch_size,
            on_error=request.on_error,
        )


def executor_for(job: Job, pipeline_id: int) -> PipelineExecutor:
    """The executor of the job's pipeline ``pipeline_id``, if it takes batches."""
    executor = job.pipelines.get(pipeline_id)
    if executor is None:
        raise RequestRefused(
            ErrorCode.UNKNOWN_PIPELINE, f"job {job.job_id} has no pipeline {pipeline_id}"
        )
    if executor.failed:
        raise RequestRefused(
            ErrorCode.PIPELINE_ERROR,
            f"pipeline {pipeline_id} stopped working and takes no more batches (the daemon's "
            "log says why): register it again",
        )
    return executor


def check_batch(executor: PipelineExecutor, request: SubmitBatch) -> None:
    """Refuses a batch its pipeline cannot take."""
    spec = executor.spec
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
