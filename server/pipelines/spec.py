"""What a pipeline of the daemon is, and how its inputs go into DALI: the spec a client's
registration (or the daemon's repository) gives, the CPU daemon's choice of DALI executor,
the error of a pipeline that cannot be built, and an input's samples as DALI takes them
fastest. ``runner.py`` builds and runs the pipeline of a spec.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dalid.protocol import ErrorCode, OnError, RegisterPipeline

from ..samples.paths import padded_paths


# Note [DALI's host buffers]
# --------------------------
# A CPU daemon runs every pipeline on DALI's legacy executor, its host buffers taken from
# malloc and kept at their largest: the runs reuse them without page faults, and they go back
# with their pipeline. The daemon copies a run's outputs out before it releases the run, so the
# default executor's fresh buffers at each run buy it nothing. Why, and the tests that hold
# it: docs/design/host-buffers.md.
class CpuExecutor(enum.Enum):
    """Which DALI executor runs the pipelines of a CPU daemon (``dalid serve --cpu-executor``):
    ``LEGACY``, DALI's executor that reuses its buffers (``exec_dynamic=False``), or
    ``CLIENT``, the one the pipeline asked for (Note [DALI's host buffers])."""

    LEGACY = "legacy"
    CLIENT = "client"


@dataclass(frozen=True)
class PipelineSpec:
    """What the daemon needs to build (and rebuild) a client's pipeline.

    A serialized pipeline, or a ``definition`` of the daemon's repository: a callable that
    returns a new unbuilt pipeline at each call (see :meth:`PipelineRunner.from_definition`).
    """

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
    definition: Callable[..., Any] | None = dataclasses.field(default=None, compare=False)
    # The inputs whose samples are file paths (they feed fn.io.file.read).
    path_inputs: tuple[str, ...] = ()

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
            path_inputs=message.path_inputs,
        )


class PipelineBuildError(Exception):
    """The pipeline could not be built on this daemon; ``code`` says why."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def feedable(samples: np.ndarray | Sequence[np.ndarray], paths: bool = False) -> Any:
    """One input's samples of a run as ``feed_input`` takes them fastest, with no Python step
    per sample here.

    An array (samples of one shape, viewed in their frame, or batches of them joined) goes as
    it is: DALI takes a dense batch at once. A list (samples of several shapes) goes as a
    ``TensorListCPU`` made of it without gathering it into one buffer (``contiguous=False``):
    DALI builds that in C++ at about 1 µs a sample, where ``feed_input`` given the list itself
    converts each sample in Python at 3 to 5 µs. ``paths``: the samples are absolute paths
    that only ``fn.io.file.read`` reads; of several lengths, they go as one dense array
    (:func:`padded_paths`).
    """
    if isinstance(samples, np.ndarray):
        return samples
    if paths:
        padded = padded_paths(samples)
        if padded is not None:
            return padded
    from nvidia.dali.tensors import TensorListCPU

    # (DALI's stubs lack the keyword.)
    return TensorListCPU(list(samples), contiguous=False)  # type: ignore[call-overload]
