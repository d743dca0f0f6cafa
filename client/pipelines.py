"""What the client reads of a DALI pipeline, and the registration that describes it to the daemon.

The client never builds a pipeline: building needs the pipeline's device in the trainer (a GPU
pipeline needs CUDA there). It reads the pipeline's Python graph (its external_source names and
its outputs, as DALI's own proxy does) and sends the serialized pipeline, which the daemon
builds on its device.

DALI's ``Pipeline.serialize()`` makes the pipeline's backend first, for the pipeline's device: in a
process that cannot see the GPU it fails ("CUDA is not available"), and otherwise the trainer's
pipeline object holds a backend for the GPU that only the daemon uses. :func:`serialize` makes
the same bytes from a backend without a device (DALI accepts GPU operators there, and the
daemon builds the pipeline for its own device whatever the bytes say), on a copy of the
pipeline object, which the trainer's object does not see.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

from dalid.protocol import Device, OnError, RegisterNamedPipeline, RegisterPipeline
from dalid.protocol.file_inputs import path_inputs

from .errors import InputError
from .named import RepositoryPipeline


def _graph(pipeline: Any) -> Any:
    """The pipeline with its Python graph built, without building the pipeline itself.

    DALI's own proxy reads the same private attributes.
    """
    if getattr(pipeline, "_deserialized", False):
        raise InputError(
            "the pipeline was deserialized, so its external_source names are unknown: pass the "
            "pipeline object built from its definition"
        )
    if not pipeline._py_graph_built:
        pipeline._build_graph()
    return pipeline


def serialize(pipeline: Any) -> bytes:
    """The pipeline serialized as ``Pipeline.serialize()`` does, without a backend for its
    device."""
    graph = _graph(pipeline)
    if graph._backend_prepared:
        return bytes(graph.serialize())  # the trainer made the backend itself: serialize that one
    detached = copy.copy(graph)
    # The copy shares the graph's operators; what making a backend changes is its own.
    detached._transfer_ops = dict(graph._transfer_ops)
    detached._pipe = None
    detached._device_id = None
    try:
        detached._init_pipeline_backend()
        detached._pipe.SetOutputDescs(detached._generate_build_args())
        return bytes(detached._pipe.SerializeToProtobuf())
    finally:
        detached._shutdown()


def external_source_names(pipeline: Any) -> list[str]:
    """The names of a pipeline's external_source operators, in definition order."""
    from nvidia.dali.external_source import ExternalSource

    return [op.name for op in _graph(pipeline)._ops if isinstance(op._op, ExternalSource)]


def readers(pipeline: Any) -> list[str]:
    """The file readers (``fn.readers.*``) of a pipeline, as ``fn.`` names: the daemon refuses
    them (they read whatever files their arguments name, as the daemon's user)."""
    names = []
    for op in _graph(pipeline)._ops:
        schema = str(op._op.schema_name)
        if "readers__" in schema:
            parts = [
                re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", part).lower() for part in schema.split("__")
            ]
            names.append("fn." + ".".join(part.strip("_") for part in parts))
        elif schema.endswith("Reader"):
            names.append(schema)
    return names


def no_inputs_hint(pipeline: Any) -> str:
    """What to do about a pipeline with no external_source: dalid feeds pipelines only
    through them, and a reader in its place is refused."""
    found = readers(pipeline)
    hint = "dalid feeds a pipeline through its fn.external_source(name=...) inputs"
    if found:
        hint += (
            f"; the daemon refuses {', '.join(dict.fromkeys(found))}, which reads the files its "
            "arguments name: "
            "have the dataset return each file's path, and read it in the pipeline with "
            'fn.io.file.read(fn.external_source(name="paths", no_copy=True)) '
            '(docs/migration.md, "Readers")'
        )
    return hint


def output_count(pipeline: Any) -> int:
    """How many outputs the pipeline's graph returns."""
    return int(_graph(pipeline)._num_outputs)


def check_pipeline(pipeline: Any) -> None:
    """Raises :class:`InputError` unless ``pipeline`` is a DALI pipeline."""
    from nvidia.dali.pipeline import Pipeline

    if not isinstance(pipeline, Pipeline):
        raise InputError(f"expected an NVIDIA DALI pipeline, got {type(pipeline).__name__}")


def pipeline_device(pipeline: Any) -> Device:
    """The device a pipeline was defined for: its device_id, or ``"cpu"`` when it has none."""
    check_pipeline(pipeline)
    return "cpu" if pipeline.device_id is None else int(pipeline.device_id)


def registration_request(
    pipeline: Any,
    on_error: str = "raise",
    *,
    deterministic: bool = False,
    share_runs: bool = True,
    cohort: str = "",
) -> RegisterPipeline | RegisterNamedPipeline:
    """The message that registers ``pipeline``: a DALI pipeline (sent serialized), or one of
    the daemon's repository (a :class:`RepositoryPipeline`, or its name). ``deterministic``:
    the daemon runs it for this job alone, one batch at a time; ``share_runs=False``: the job's
    batches never share a run with other jobs' batches; ``cohort``: the cohort the job joins
    with it ("" for none). Bad arguments raise :class:`InputError` before anything is sent."""
    if not isinstance(cohort, str) or len(cohort) > 256:
        raise InputError(f"cohort must be a name of at most 256 characters, got {cohort!r}")
    try:
        policy = OnError(on_error)
    except ValueError:
        raise InputError(
            f"on_error must be one of {[p.value for p in OnError]}, got {on_error!r}"
        ) from None
    if isinstance(pipeline, str):
        pipeline = RepositoryPipeline(pipeline)
    if isinstance(pipeline, RepositoryPipeline):
        return dataclasses.replace(
            pipeline.request(),
            on_error=policy,
            deterministic=deterministic,
            share_runs=share_runs,
            cohort=cohort,
        )
    check_pipeline(pipeline)
    names = external_source_names(pipeline)
    if not names:
        raise InputError(f"the pipeline has no external_source: {no_inputs_hint(pipeline)}")
    depth = pipeline.prefetch_queue_depth
    if isinstance(depth, dict):
        depth = max(depth.values())
    return RegisterPipeline(
        serialized=memoryview(serialize(pipeline)),
        input_names=tuple(names),
        num_outputs=output_count(pipeline),
        max_batch_size=pipeline.max_batch_size,
        num_threads=pipeline.num_threads,
        prefetch_queue_depth=int(depth),
        seed=pipeline.seed,
        exec_dynamic=bool(pipeline.exec_dynamic),
        name=getattr(pipeline, "_name", None) or "",
        on_error=policy,
        deterministic=deterministic,
        path_inputs=path_inputs(pipeline),
        share_runs=share_runs,
        cohort=cohort,
    )
