"""A DALI pipeline rebuilt from its serialized form: plain DALI, no sockets, no threads.

The daemon's executors drive it; tests drive it directly in-process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dalid.protocol import ErrorCode, InputBatch, OnError, RegisterPipeline


@dataclass(frozen=True)
class PipelineSpec:
    """What the daemon needs to build (and rebuild) a client's pipeline."""

    serialized: bytes
    input_names: tuple[str, ...]
    num_outputs: int
    max_batch_size: int
    num_threads: int
    prefetch_queue_depth: int
    seed: int | None = None
    exec_dynamic: bool = True
    name: str = ""
    on_error: OnError = OnError.RAISE

    @classmethod
    def from_message(cls, message: RegisterPipeline) -> PipelineSpec:
        return cls(
            serialized=bytes(message.serialized),
            input_names=message.input_names,
            num_outputs=message.num_outputs,
            max_batch_size=message.max_batch_size,
            num_threads=message.num_threads,
            prefetch_queue_depth=message.prefetch_queue_depth,
            seed=message.seed,
            exec_dynamic=message.exec_dynamic,
            name=message.name,
            on_error=message.on_error,
        )


class PipelineBuildError(Exception):
    """The pipeline could not be built on this daemon; ``code`` says why."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def sample_arrays(batch: InputBatch) -> list[np.ndarray]:
    """Numpy views (no copy) of one input's samples, as DALI's ``feed_input`` takes them."""
    dtype = np.dtype(batch.dtype)
    return [
        np.frombuffer(sample, dtype=dtype).reshape(shape)
        for sample, shape in zip(batch.samples, batch.shapes, strict=True)
    ]


class PipelineRunner:
    """Builds the pipeline of ``spec`` for ``device_id`` (None: CPU only) and runs batches.

    ``schedule`` feeds one batch and starts it; ``collect`` returns the outputs of the oldest
    scheduled batch. After a failure the DALI pipeline object is dead: ``rebuild`` replaces it.
    """

    def __init__(self, spec: PipelineSpec, device_id: int | None) -> None:
        self.spec = spec
        self.device_id = device_id
        self._pipeline: Any = None
        self.scheduled = 0
        self._build()

    def _build(self) -> None:
        from nvidia.dali import Pipeline

        kwargs: dict[str, Any] = {
            "batch_size": self.spec.max_batch_size,
            "num_threads": self.spec.num_threads,
            "device_id": self.device_id,
            "prefetch_queue_depth": self.spec.prefetch_queue_depth,
            # A deserialized pipeline defaults to the legacy executor; keep the client's choice.
            "exec_dynamic": self.spec.exec_dynamic,
        }
        if self.spec.seed is not None:
            kwargs["seed"] = self.spec.seed
        try:
            pipeline = Pipeline.deserialize(serialized_pipeline=self.spec.serialized, **kwargs)
            pipeline.build()
        except Exception as error:
            text = str(error)
            if self.device_id is None and ("CUDA" in text or "GPU" in text):
                raise PipelineBuildError(
                    ErrorCode.DEVICE_MISMATCH,
                    "the pipeline has GPU operators (device='mixed' or 'gpu') but this daemon runs "
                    "CPU pipelines only: connect to a daemon started with `dalid serve --device N` "
                    f"(DALI said: {text.strip().splitlines()[-1]})",
                ) from None
            raise PipelineBuildError(
                ErrorCode.INVALID_PIPELINE, f"DALI could not build the pipeline: {text.strip()}"
            ) from None
        self._pipeline = pipeline
        self.scheduled = 0

    def schedule(self, inputs: Mapping[str, Sequence[np.ndarray]]) -> None:
        """Feeds every external_source its samples and schedules one run."""
        for name in self.spec.input_names:
            self._pipeline.feed_input(name, list(inputs[name]))
        # Not schedule_run(): its first call prefetches prefetch_queue_depth runs at once,
        # which needs that many batches fed up front. DALI's own proxy schedules this way.
        self._pipeline._run_once()
        self.scheduled += 1

    def collect(self, cuda_stream: int | None = None) -> tuple[Any, ...]:
        """The outputs (DALI TensorLists) of the oldest scheduled run.

        With ``cuda_stream`` (a ``cudaStream_t``; the default executor only) GPU outputs, and CPU
        outputs copied from the GPU, are ready in that stream's order instead of on the host.
        """
        self.scheduled -= 1
        outputs = tuple(self._pipeline.outputs(cuda_stream))
        if len(outputs) != self.spec.num_outputs:
            raise PipelineBuildError(
                ErrorCode.INVALID_OUTPUT,
                f"the pipeline returned {len(outputs)} outputs, the client declared "
                f"{self.spec.num_outputs}",
            )
        return outputs

    def release(self) -> None:
        """Returns the collected outputs' buffers to DALI once they have been copied out.

        The legacy executor (``exec_dynamic=False``) keeps them in its prefetch queue until
        this call, and blocks the next run while the queue is full.
        """
        if not self.spec.exec_dynamic:
            self._pipeline.release_outputs()

    def rebuild(self) -> None:
        """A fresh pipeline after an error; batches scheduled on the old one are gone."""
        self.close()
        self._build()

    def close(self) -> None:
        self._pipeline = None
        self.scheduled = 0
